#!/usr/bin/env bash
# cbjax's side of the serving side-by-side: `cbjax serve` on 127.0.0.1 and a free port with
# scripts/bench_vllm_serve.sh's limits (16 seqs, max model len 1024, float32), driven by
# `cbjax bench serve --base-url` at each request rate, then stopped by its pid.
#   scripts/bench_cbjax_serve.sh [RATE ...]       # default: 1 2 4 requests/s
# Environment: PYTHON (default .venv/bin/python), NUM_PROMPTS (default 32), MODEL (default
# checkpoints/smollm2-135m-instruct: the same weights as vLLM's downloads/smollm2-135m-instruct-hf),
# SERVE_FLAGS (more `cbjax serve` flags, e.g. "--max-num-batched-tokens 2048", vLLM-CPU's server default),
# GIL_PROFILE=1 (sample the server with `py-spy record --threads --gil` while the rates run, then print
# each thread's share of the GIL: cbjax.bench.serve_gil; needs `pip install py-spy`).
# Results: bench_results/cbjax_serve_rate<R>.json and the server's log bench_results/cbjax_serve.log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/serve_rates.sh
py=${PYTHON:-.venv/bin/python}
rates=("$@")
[[ $# -eq 0 ]] && rates=(1 2 4)
mkdir -p bench_results
port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
PYTHONPATH=$PWD "$py" -m cbjax serve "${MODEL:-checkpoints/smollm2-135m-instruct}" --host 127.0.0.1 \
  --port "$port" --max-num-seqs 16 --max-model-len 1024 --dtype float32 --compilation-cache-dir .jax_cache ${SERVE_FLAGS:-} \
  > bench_results/cbjax_serve.log 2>&1 &
pid=$!
# SIGTERM: cbjax serve finishes in-flight requests (none by then) and exits.
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT
wait_healthy "$pid" "$port" bench_results/cbjax_serve.log
if [[ -n "${GIL_PROFILE:-}" ]]; then
  spy_rate=100
  "$(dirname "$py")/py-spy" record --pid "$pid" --threads --gil --nonblocking --rate $spy_rate --format raw \
    --output bench_results/cbjax_serve_gil.txt > bench_results/cbjax_serve_gil.log 2>&1 &
  spy=$!
  started=$(date +%s)
fi
drive_rates cbjax_serve "$port" "${rates[@]}"
if [[ -n "${GIL_PROFILE:-}" ]]; then
  kill -INT "$spy"; wait "$spy" || true
  PYTHONPATH=$PWD "$py" -m cbjax.bench.serve_gil bench_results/cbjax_serve_gil.txt \
    --seconds $(( $(date +%s) - started )) --rate $spy_rate | tee bench_results/cbjax_serve_gil_summary.txt
fi
