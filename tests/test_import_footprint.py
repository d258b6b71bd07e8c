"""`from cbjax import LLM` stays light: no server, checkpoint-writing or test-reference packages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The OpenAI server's stack, orbax (only a first load or `cbjax convert` needs it: later loads map
# the weights cache), the test references and the grammar engine (a constrained request imports it):
# none belongs in an offline LLM's process until it is used.
HEAVY = ("fastapi", "uvicorn", "starlette", "prometheus_client", "orbax", "tensorstore", "torch", "transformers",
         "llguidance")


def test_importing_llm_imports_no_server_or_checkpoint_writer():
    code = f"import json, sys; from cbjax import LLM, SamplingParams; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
