#!/usr/bin/env bash
# The test suite on CPU (GPU-marked tests skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh test,ref
bash scripts/fetch_model.sh > /dev/null  # the real-model tests use it
.venv/bin/python -m pytest -q "$@"
