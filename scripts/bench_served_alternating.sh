#!/usr/bin/env bash
# Served throughput of tokenloop and llama.cpp's server, alternated, several runs each, one stream count:
#   scripts/bench_served_alternating.sh STREAMS [ROUNDS] [SEEDS]     e.g. 1 2 "1 2 3"  or  32 1 "0 1 2"
# Each round starts each server once (127.0.0.1 only) and runs the bench_served.sh client once per seed:
# streaming chat, 32 random prompt tokens in the chat template, 64 output tokens; one stream runs 4 requests
# one after another, N streams N requests at once. One run is too noisy on 2 cores: compare medians.
# MODEL=FILE serves that GGUF on both sides (default: the default model).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8124}
STREAMS=${1:?usage: $0 STREAMS [ROUNDS] [SEEDS]}
ROUNDS=${2:-2}
SEEDS=${3:-1 2 3}
PROMPTS=$(( STREAMS == 1 ? 4 : STREAMS ))
for round in $(seq 1 "$ROUNDS"); do
  for target in auto llama.cpp; do
    if [[ $target == llama.cpp ]]; then
      PYTHON=$PY LLAMA_CPP_MODEL=${MODEL:-} scripts/baselines/llama_cpp.sh server --host 127.0.0.1 \
        --port "$PORT" -np 32 -c 16384 --log-disable >/dev/null 2>&1 &
    else
      "$PY" -m tokenloop serve --port "$PORT" ${MODEL:+--model "$MODEL"} --dtype auto --no-trace \
        --log-level warning >/dev/null 2>&1 &
    fi
    pid=$!
    trap 'kill -INT $pid 2>/dev/null || true' EXIT
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
    bench() { "$PY" -m tokenloop bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions \
      --dataset random --request-rate inf --random-input-len 32 "$@" 2>/dev/null; }
    bench --num-prompts 2 --max-concurrency 2 --random-output-len 16 --seed 1 >/dev/null  # warm-up
    for seed in $SEEDS; do
      result=$(bench --num-prompts "$PROMPTS" --max-concurrency "$STREAMS" --random-output-len 64 --seed "$seed" \
        | grep -iE "output token throughput|mean ttft|mean tpot" | awk -F: '{gsub(/ +/, " "); printf "%s:%s ", $1, $2}')
      echo "streams=$STREAMS target=$target round=$round seed=$seed $result"
    done
    kill -INT "$pid"; wait "$pid" 2>/dev/null || true
    trap - EXIT
  done
done
