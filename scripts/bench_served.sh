#!/usr/bin/env bash
# Served throughput of tokenloop at 1, 8 and 32 streaming chat clients, one server per dtype, one after
# the other on port 8123 (127.0.0.1 only): `scripts/bench_served.sh [DTYPE ...]` (default: auto float32).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8123}
for dtype in "${@:-auto float32}"; do
  for d in $dtype; do
    "$PY" -m tokenloop serve --port "$PORT" --dtype "$d" --no-trace --log-level warning &
    pid=$!
    trap 'kill -INT $pid 2>/dev/null || true' EXIT
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
    bench() { "$PY" -m tokenloop bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions \
      --dataset random --request-rate inf --random-input-len 32 "$@"; }
    bench --num-prompts 2 --max-concurrency 2 --random-output-len 16 --seed 1 >/dev/null  # warm-up
    for c in 1 8 32; do
      echo "=== dtype=$d streams=$c"
      bench --num-prompts "$c" --max-concurrency "$c" --random-output-len 64 --seed 0 \
        | grep -iE "output token throughput|mean ttft|mean tpot|mean itl"
    done
    kill -INT "$pid"; wait "$pid" || true
    trap - EXIT
  done
done
