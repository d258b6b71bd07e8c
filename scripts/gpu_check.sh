#!/usr/bin/env bash
# One call on a GPU host (the device tool's machine): the whole test suite (the auto backend
# picks the compiled Pallas kernels there), the kernel benchmark, the engine decode benchmark.
# Writes JSON results under ${OUT:-gpu_results}/ and prints a short table of each.
#   device run: bash scripts/gpu_check.sh   (about 10 minutes on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
out=${OUT:-gpu_results}
mkdir -p "$out"
echo "== tests (CPU-only real-model tests skip without downloads/)"
timeout 240 python3 -m pytest -q -x 2>&1 | tail -15
echo "== kernels: bandwidth vs device copy and vs jax.experimental.pallas.ops.gpu.paged_attention"
timeout 220 python3 -m cbjax.bench.kernels --no-tests --max-seconds 180 --out "$out/kernels.json" 2>&1 | tail -40
echo "== engine decode step, Llama-3-8B shapes, bf16, against the bandwidth floor"
timeout 200 python3 -m cbjax.bench.gpu_engine --out "$out/engine_gpu.json" 2>&1 | tail -8
