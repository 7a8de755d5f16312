#!/usr/bin/env bash
# Served decode speed of a mixture-of-experts GGUF (scripts/make_moe_gguf.py: OLMoE-1B-7B's shape) at 1 and 8
# streaming chat clients of 64 tokens, tokenloop and then llama.cpp's llama-server on the same file, one after
# the other on a free port of 127.0.0.1, the same client (`tokenloop bench serve`) against each:
#   scripts/bench_moe.sh MODEL.gguf [TARGET ...]     (default targets: tokenloop llama.cpp)
# llama.cpp runs only where its binary is already built (scripts/baselines/llama_cpp.sh build; never started
# from here: the build takes both cores for minutes). One stream runs 4 requests one after another; 8 streams
# one request each. A server gets 15 minutes to load (packing a 7 GB file on a loaded 2-core machine).
# THREADS (default: all cores): both servers' threads (tokenloop's through OMP_NUM_THREADS); LLAMA_ARGS:
# more llama-server options (e.g. --poll 0). On a machine shared with other busy processes, OpenMP threads
# that spin at every barrier lose their time slices: run with OMP_WAIT_POLICY=PASSIVE there (BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: scripts/bench_moe.sh MODEL.gguf [tokenloop|llama.cpp ...]}
shift
PY=${PY:-.venv/bin/python}
# A port nobody listens on (others benchmark on this machine too): a server that cannot bind must not leave
# the client measuring someone else's.
PORT=${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
THREADS=${THREADS:-$(nproc)}
LLAMA_SERVER="${TOKENLOOP_LLAMA_CPP_DIR:-$HOME/.cache/tokenloop/llama.cpp}/build/bin/llama-server"
start_server() {
  if [[ "$1" == llama.cpp ]]; then
    "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -t "$THREADS" -np 8 -c 8192 \
      ${LLAMA_ARGS:-} >/dev/null 2>&1 &
  else
    OMP_NUM_THREADS=$THREADS "$PY" -m tokenloop serve --model "$MODEL" --port "$PORT" --max-model-len 1024 \
      --no-trace --log-level warning &
  fi
  pid=$!
}
tree_rss_gb() {  # resident memory of a server and its children (tokenloop's engine core is a child process)
  local pids="$1" all="$1"
  while pids=$(pgrep -d, -P "$pids" 2>/dev/null); do all="$all,$pids"; done
  ps -o rss= -p "$all" | awk '{s += $1} END {printf "%.2f GB", s / 1e6}'
}
for t in "${@:-tokenloop llama.cpp}"; do
  if [[ "$t" == llama.cpp && ! -x "$LLAMA_SERVER" ]]; then
    echo "=== target=llama.cpp: $LLAMA_SERVER is not built; not measured"
    continue
  fi
  start=$(date +%s)
  start_server "$t"
  trap 'kill -INT $pid 2>/dev/null || true' EXIT
  for _ in $(seq 1 1800); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
  kill -0 "$pid" || { echo "=== target=$t: the server exited (port $PORT taken?)"; exit 1; }
  echo "=== target=$t threads=$THREADS ready after $(( $(date +%s) - start )) s, RSS $(tree_rss_gb "$pid")"
  bench() { "$PY" -m tokenloop bench serve --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/chat/completions --dataset random --request-rate inf --random-input-len 32 "$@"; }
  bench --num-prompts 2 --max-concurrency 2 --random-output-len 16 --seed 1 >/dev/null  # warm-up
  for c in 1 8; do
    echo "=== target=$t streams=$c"
    bench --num-prompts "$(( c == 1 ? 4 : c ))" --max-concurrency "$c" --random-output-len 64 --seed 0 \
      | grep -iE "output token throughput|mean ttft|mean tpot|mean itl"
  done
  kill -INT "$pid" || true; wait "$pid" || true
  trap - EXIT
done
