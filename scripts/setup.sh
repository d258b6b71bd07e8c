#!/usr/bin/env bash
# Create .venv and install cbjax with its test and reference extras (CPU jax; no CUDA wheels).
# Re-running is cheap: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.cbjax-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch==2.13.0 (the ref extra) is the CPU wheel; transformers only serves as a test reference.
  .venv/bin/python -m pip install --quiet -e ".[test,ref]"
  echo "$want" > "$stamp"
fi
