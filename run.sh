#!/usr/bin/env bash
# The main job: install, fetch + import + convert SmolLM2-135M-Instruct, then answer a batch of
# prompts with continuous batching and print the answers, tokens/s and the engine stats.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
bash scripts/fetch_model.sh
.venv/bin/python -m cbjax.entrypoints.demo --model checkpoints/smollm2-135m-instruct "$@"
