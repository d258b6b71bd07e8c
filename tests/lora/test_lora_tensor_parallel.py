"""LoRA under tensor parallelism over 2 virtual CPU devices, on a tiny Qwen3: the adapters' factors split
as the projections they adapt, one batch mixing three adapters (max_loras=3) and the base gives each
request peft's greedy tokens, and every step lowers for CUDA with those shardings. The engine runs in a subprocess (lora_tp_checks.py): the device count is
fixed when jax starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def findings() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [str(HERE.parents[1]), str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "lora_tp_checks.py")], env=env, capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_mixed_adapters_under_tp_give_peft_greedy_tokens(findings):
    assert findings["token_ids"] == findings["expected"]


def test_lora_factors_split_as_the_projection_they_adapt(findings):
    """Tiny Qwen3: hidden 64, 4 heads x 32 (q 128), 2 KV heads (k, v 64), MLP 128; max_loras 3, rank 8; 2 devices."""
    shards = {name.removeprefix("model.layers.0."): shapes for name, shapes in findings["shard_shapes"].items()}
    assert shards["self_attn.q_proj.lora.a"] == [[1, 3, 8, 64]]  # column-parallel: A whole
    assert shards["self_attn.q_proj.lora.b.0"] == [[3, 8, 64]]  # B split by output columns
    assert shards["self_attn.k_proj.lora.b.0"] == [[3, 8, 32]]
    assert shards["mlp.gate_proj.lora.b.0"] == [[3, 8, 64]]
    assert shards["self_attn.o_proj.lora.a"] == [[1, 3, 8, 64]]  # row-parallel: A split by input rows (128)
    assert shards["self_attn.o_proj.lora.b.0"] == [[3, 8, 64]]  # B whole
    assert shards["mlp.down_proj.lora.a"] == [[1, 3, 8, 64]]


def test_every_lora_step_lowers_for_cuda_under_tp(findings):
    assert findings["cuda_lowering_failures"] == []
