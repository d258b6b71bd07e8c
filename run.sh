#!/usr/bin/env bash
# The main job: install, fetch SmolLM2-135M-Instruct's GGUF file, import + convert it into a float32
# checkpoint (scripts/fetch_model.sh), then serve the GGUF file as stored (its Q4_1 projections stay 4-bit)
# to answer a batch of prompts with continuous batching and print the answers, tokens/s and the engine
# stats. `--model checkpoints/smollm2-135m-instruct` serves the converted float32 checkpoint instead.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
bash scripts/fetch_model.sh > /dev/null  # prints the checkpoint path
gguf=$(.venv/bin/python -c "from cbjax.checkpoint.smollm2 import fetch_smollm2_gguf; print(fetch_smollm2_gguf('downloads'))")
.venv/bin/python -m cbjax.entrypoints.demo --model "$gguf" "$@"
