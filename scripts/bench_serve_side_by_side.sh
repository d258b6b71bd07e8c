#!/usr/bin/env bash
# `cbjax serve` against `vllm serve` back to back in one run: same SmolLM2 weights (float32), same
# limits (16 seqs, max model len 1024), same workload and rates; one JSON and a Markdown table.
#   CBJAX_PEER_VENVS=/work/peer-venvs scripts/bench_serve_side_by_side.sh [RATE ...]   # default 1 2 4
# Results: bench_results/serve_side_by_side.json (+ the per-server, per-rate JSONs and logs).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
rates=("$@")
[[ $# -eq 0 ]] && rates=(1 2 4)
loadavg() { echo "$1: $(cut -d' ' -f1-3 /proc/loadavg)"; }
load=("$(loadavg "cbjax start")")
bash scripts/bench_cbjax_serve.sh "${rates[@]}"
load+=("$(loadavg "cbjax end, vllm start")")
bash scripts/bench_vllm_serve.sh "${rates[@]}"
load+=("$(loadavg "vllm end")")
args=()
for l in "${load[@]}"; do args+=(--loadavg "$l"); done
"$py" benchmarks/serve_side_by_side.py --rates "${rates[@]}" "${args[@]}" --out bench_results/serve_side_by_side.json
