#!/usr/bin/env bash
# Create .venv and install cbjax (CPU jax; no CUDA wheels), with the extras named by the first
# argument: run.sh needs none; test.sh asks for "test,ref" (pytest, and torch + transformers as
# test references). Re-running is cheap: it reinstalls only when pyproject.toml or the extras changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.cbjax-installed${extras:+-${extras//,/-}}
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "installing cbjax${extras:+ with [$extras]} into .venv (pip shows its progress)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch==2.13.0 (the ref extra) is the CPU wheel; transformers only serves as a test reference.
  .venv/bin/python -m pip install --progress-bar on -e ".${extras:+[$extras]}"
  echo "$want" > "$stamp"
fi
