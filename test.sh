#!/usr/bin/env bash
# The test suite on CPU (GPU-marked tests skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh test,ref
bash scripts/fetch_model.sh > /dev/null  # the real-model tests use it
# Two worker processes, each taking whole test files (module-scoped engines stay in one process),
# keep both of a 2-core machine's cores busy (README, Tests). On a GPU host one process, as every
# worker would claim the GPU's memory (scripts/gpu_check.sh shares it out explicitly).
workers=2
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then workers=0; fi
# The slowest tests are listed at the end: the suite must stay well under 15 minutes on 2 cores.
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile --durations=15 "$@"
