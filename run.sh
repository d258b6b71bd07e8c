#!/usr/bin/env bash
# The main job: install, fetch SmolLM2-135M-Instruct's GGUF file, then serve it as stored (its Q4_1
# projections stay 4-bit) to answer a batch of prompts with continuous batching and print the answers,
# tokens/s and the engine stats. `cbjax import-gguf` + `cbjax convert` (scripts/fetch_model.sh) still
# make the float32 checkpoint for those who want one.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
gguf=$(.venv/bin/python -c "from cbjax.checkpoint.smollm2 import fetch_smollm2_gguf; print(fetch_smollm2_gguf('downloads'))")
.venv/bin/python -m cbjax.entrypoints.demo --model "$gguf" "$@"
