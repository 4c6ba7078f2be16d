#!/bin/bash
# DP=1 against DP=2 at concurrency 16, alternated rounds, through `pagedllm bench serve`
# (results of 2026-12-02: results/data_parallel-2026-12-02.json).
# Usage: benchmarks/data_parallel.sh [OUT_DIR] [ROUNDS]; needs `pagedllm` on PATH and curl.
set -u
OUT=${1:-benchmarks/results/data_parallel-runs}
ROUNDS=${2:-3}
PORT=${PORT:-8720}
mkdir -p "$OUT"
run() {  # name, serve flags...
  local name=$1; shift
  pagedllm serve --port "$PORT" --kv-cache-memory 512MiB --log-level warning "$@" > "$OUT/server-$name.log" 2>&1 &
  local spid=$! t
  for t in $(seq 1 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
  echo "$name before: $(cat /proc/loadavg)" >> "$OUT/load.txt"
  pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --max-concurrency 16 --num-prompts 48 \
      --dataset-name random --input-len 128 --output-len 64 --seed 0 --result-file "$OUT/$name.json"
  echo "$name after: $(cat /proc/loadavg)" >> "$OUT/load.txt"
  curl -s "localhost:$PORT/stats" > "$OUT/stats-$name.json"  # per-replica counters under "replicas"
  kill "$spid"; wait "$spid"
}
for r in $(seq 1 "$ROUNDS"); do
  run "dp1-r$r" --data-parallel-size 1
  run "dp2-r$r" --data-parallel-size 2
done
