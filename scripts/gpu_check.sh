#!/usr/bin/env bash
# One call on a GPU host (the device tool's machine): the compiled Pallas kernels against the
# reference (pytest -m gpu), the kernel benchmark, sliding-window and expert-matmul benchmarks, the
# engine decode step at Llama-3-8B shapes,
# whole-engine throughput on a random-weight Llama-3.2-1B-shaped model (Pallas vs XLA attention; then
# int8, int4 and fp8 weights and an fp8 KV pool on the same model and workload),
# a tensor-parallel run where there are several GPUs, then as much of the full suite as time leaves.
# Writes logs and JSON under ${OUT:-gpu_results}/ and prints a short table of each.
#
#   device run, from the repo root (GPU_CHECK_SECONDS, default 400, bounds the whole run):
#     bash scripts/gpu_check.sh
#   carrying .whl (wheels of the server's and the GGUF reader's packages, which the GPU image lacks)
#   and .gpu_carry/tokenizer (a tokenizer.json for the engine run), prepared here with
#     bash scripts/gpu_carry.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CBJAX_CACHE_DIR=/tmp/cbjax-cache
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.:scripts
else
  export PYTHONPATH=.:scripts
fi
exec > >(tee "$out/gpu_check.log") 2>&1
# The GPU image has no schemathesis (the server fuzz test's tool): leave that file out rather than
# let its import stop the whole collection.
skip=()
python3 -c "import schemathesis" 2>/dev/null || skip=(--ignore=tests/entrypoints/test_server_fuzz.py)
# Every phase gets at most its own cap and never runs past the whole budget, so a cut run still
# leaves each finished phase's results (and the log) in $out.
deadline=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-400} ))
left() { local l=$(( deadline - $(date +%s) )); (( l < $1 )) && echo $(( l > 5 ? l : 5 )) || echo "$1"; }
phase() { echo; echo "== $1 ($(date +%T), $(( deadline - $(date +%s) )) s left)"; }
# GPU_CHECK_PHASES picks phases (default all):
#   machine gpu-tests kernels sliding-window moe engine-step throughput quantized tp suite
all_phases="machine gpu-tests kernels sliding-window moe engine-step throughput quantized tp suite"
want() { [[ " ${GPU_CHECK_PHASES:-$all_phases} " == *" $1 "* ]]; }
# The throughput, quantized and tp phases' one workload on /tmp/random-1b, so their results compare.
workload=(--num-prompts 128 --input-len 256 --output-len 128 --range-ratio 0.5 --max-num-seqs 128 --max-model-len 1024)

if want machine; then
phase "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"

fi
if want gpu-tests; then
phase "GPU-marked tests: compiled kernels vs the jnp reference"
timeout $(left 120) python3 -m pytest -q -p no:cacheprovider -m gpu "${skip[@]}" tests/ 2>&1 | tee "$out/tests_gpu.log" | tail -25

fi
if want kernels; then
phase "kernels: bandwidth vs a device copy and vs jax.experimental.pallas.ops.gpu.paged_attention"
timeout $(left 75) python3 -m benchmarks.kernels --no-tests --max-seconds 50 --out "$out/kernels.json" 2>&1 | tail -30

fi
if want sliding-window; then
phase "sliding-window attention: windowed vs full layer time as the context grows (Llama-3-8B heads, bf16)"
timeout $(left 150) python3 -m benchmarks.sliding_window --repeats 5 --inner 3 --out "$out/sliding_window.json" 2>&1 | tail -30

fi
if want moe; then
phase "mixture-of-experts: grouped (ragged_dot) vs dense-masked expert matmuls, bf16 weights"
timeout $(left 150) python3 -m benchmarks.moe_matmul --configs small-qwen3-moe qwen3-30b-a3b mixtral-8x7b \
  --dtype bfloat16 --calls 5 --rounds 2 --result-json "$out/moe_matmul.json" 2>&1 | tail -30

fi
if want engine-step; then
phase "engine decode step, Llama-3-8B shapes, bf16, against the bandwidth floor"
timeout $(left 90) python3 -m benchmarks.gpu_engine --out "$out/engine_gpu.json" 2>&1 | tail -8

fi
if want throughput; then
phase "engine throughput, random Llama-3.2-1B-shaped weights, Pallas vs XLA attention"
if [ -f .gpu_carry/tokenizer/tokenizer.json ]; then
  timeout $(left 40) python3 benchmarks/random_hf_model.py --shape llama-3.2-1b --tokenizer-dir .gpu_carry/tokenizer --out /tmp/random-1b
  for backend in ${GPU_CHECK_THROUGHPUT_BACKENDS:-pallas xla}; do
    timeout $(left 80) python3 -m cbjax bench throughput --model /tmp/random-1b --attention-backend "$backend" \
      "${workload[@]}" --result-json "$out/throughput_$backend.json" 2>&1 | grep -v "it/s\]" | tail -4
  done
else
  echo "skipped: no .gpu_carry/tokenizer/tokenizer.json (bash scripts/gpu_carry.sh makes it)"
fi

fi
if want quantized; then
phase "engine throughput, the same model and workload: int8, int4 weights; fp8 KV with calculated scales; fp8 weights"
if [ -d /tmp/random-1b ]; then
  for variant in "int8:--quantization int8" "int4:--quantization int4" "fp8_kv:--kv-cache-dtype fp8 --calculate-kv-scales"; do
    # shellcheck disable=SC2086  # the flags are words
    timeout $(left 80) python3 -m cbjax bench throughput --model /tmp/random-1b ${variant#*:} \
      "${workload[@]}" --result-json "$out/throughput_${variant%%:*}.json" 2>&1 | grep -v "it/s\]" | tail -4
  done
  # The same random weights as an fp8 checkpoint (e4m3 projections, served as stored: XLA's int8 product)
  timeout $(left 40) python3 benchmarks/random_hf_model.py --shape llama-3.2-1b --tokenizer-dir .gpu_carry/tokenizer \
    --fp8 --out /tmp/random-1b-fp8
  timeout $(left 80) python3 -m cbjax bench throughput --model /tmp/random-1b-fp8 "${workload[@]}" \
    --result-json "$out/throughput_fp8_weights.json" 2>&1 | grep -v "it/s\]" | tail -4
else
  echo "skipped: no /tmp/random-1b (the throughput phase writes it)"
fi

fi
if want tp; then
phase "tensor parallel"
ngpu=$(python3 -c "import jax; print(jax.device_count())")
if [ "$ngpu" -ge 2 ] && [ -d /tmp/random-1b ]; then
  timeout $(left 90) python3 -m cbjax bench throughput --model /tmp/random-1b --tensor-parallel-size "$ngpu" \
    "${workload[@]}" --result-json "$out/throughput_tp$ngpu.json" 2>&1 | grep -v "it/s\]" | tail -4
else
  echo "skipped: $ngpu GPU(s)"
fi

fi
if want suite; then
phase "the whole suite on the GPU backend, as far as the time left goes"
# Eight processes share the GPU: each takes memory as it needs it, up to 11% of the GPU (engines
# without an explicit pool size it from that limit). Each failure's report is written as it
# happens (scripts/pytest_failure_log.py), so a cut run keeps them.
PYTEST_FAILURE_LOG="$out/failures.log" XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.11 \
  timeout $(left 600) \
  python3 -m pytest -q -p no:cacheprovider -p pytest_failure_log -n 8 \
  --timeout 120 "${skip[@]}" tests/ 2>&1 | tee "$out/tests_all.log" | tail -30
fi
phase "done"
