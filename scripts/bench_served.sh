#!/usr/bin/env bash
# Served throughput at 1, 8 and 32 streaming chat clients, one server after the other on port 8123
# (127.0.0.1 only), the same client (`tokenloop bench serve`) against each:
#   scripts/bench_served.sh [TARGET ...]      (default: auto float32)
# A TARGET is a tokenloop dtype (auto, float32, bfloat16, ...) or `llama.cpp` (llama-server on the same GGUF,
# built by scripts/baselines/llama_cpp.sh, 32 parallel slots). One stream runs 4 requests one after another
# (one 64-token request alone is too noisy to read); 8 and 32 streams run one request per stream.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8123}
start_server() {
  if [[ "$1" == llama.cpp ]]; then
    PYTHON="$PY" scripts/baselines/llama_cpp.sh server --host 127.0.0.1 --port "$PORT" -np 32 -c 16384 \
      --log-disable >/dev/null 2>&1 &
  else
    "$PY" -m tokenloop serve --port "$PORT" --dtype "$1" --no-trace --log-level warning &
  fi
  pid=$!
}
for target in "${@:-auto float32}"; do
  for t in $target; do
    start_server "$t"
    trap 'kill -INT $pid 2>/dev/null || true' EXIT
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
    bench() { "$PY" -m tokenloop bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions \
      --dataset random --request-rate inf --random-input-len 32 "$@"; }
    bench --num-prompts 2 --max-concurrency 2 --random-output-len 16 --seed 1 >/dev/null  # warm-up
    for c in 1 8 32; do
      echo "=== target=$t streams=$c"
      bench --num-prompts "$(( c == 1 ? 4 : c ))" --max-concurrency "$c" --random-output-len 64 --seed 0 \
        | grep -iE "output token throughput|mean ttft|mean tpot|mean itl"
    done
    kill -INT "$pid"; wait "$pid" || true
    trap - EXIT
  done
done
