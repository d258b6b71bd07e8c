#!/usr/bin/env bash
# Prepares, on a development machine with PyPI, what scripts/gpu_check.sh carries to the GPU machine
# (no network there, a 64 MiB upload): .whl/ holds wheels of the packages cbjax needs that the GPU
# image lacks (Python 3.12, x86-64), .gpu_carry/tokenizer/ the built-in model's tokenizer files.
# Then: device run `bash scripts/gpu_check.sh` with carry [".whl", ".gpu_carry"].
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
mkdir -p .whl .gpu_carry/tokenizer
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0 openai==3.57.0 distro==1.9.0 \
  jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 opentelemetry-api==1.45.2 gguf==0.19.0 \
  llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
hf=downloads/smollm2-135m-instruct-hf
[ -f "$hf/tokenizer.json" ] || { echo "no $hf: run bash scripts/fetch_model.sh first" >&2; exit 1; }
cp "$hf"/tokenizer.json "$hf"/tokenizer_config.json "$hf"/config.json .gpu_carry/tokenizer/
du -sh .whl .gpu_carry
