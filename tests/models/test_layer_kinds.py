"""A step traces each kind of decoder layer once (llama._decoder_layer): layers alike in structure, shapes and
static attributes share one graphdef. The layer's index is not one of those attributes, or every layer would be
its own kind (cbjax lower --config llama-3-70b took 19 s instead of 8 when each of its 80 layers traced apart)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx
from tiny_checkpoint import make_tiny_checkpoint

import cbjax.models.llama as llama
from cbjax.checkpoint.loader import load_model
from cbjax.models.layers.attention import AttentionPlan
from cbjax.models.layers.kv_pool import init_kv_pool
from cbjax.worker.kv_scales import prompt_step, set_kv_scales


def layer_kinds(model) -> list[int]:
    """Each layer's kind: the index of the first layer whose graphdef equals its own."""
    graphdefs = [nnx.split(layer)[0] for layer in model.model.layers]
    return [graphdefs.index(graphdef) for graphdef in graphdefs]


@pytest.mark.parametrize(("arch", "overrides", "kinds"), [
    ("llama", {"num_hidden_layers": 3}, [0, 0, 0]),
    ("gemma3_text", {"head_dim": 16}, [0, 1, 0, 1]),  # local (own RoPE base, a window) and global, alternating
    ("qwen3_moe", {}, [0, 1]),  # layer 1's MLP dense, layer 0's experts
])
def test_alike_layers_share_one_graphdef(tmp_path, arch, overrides, kinds):
    model, _ = load_model(make_tiny_checkpoint(tmp_path, arch, **overrides)[1])
    assert layer_kinds(model) == kinds


def test_a_step_traces_alike_layers_once_and_layers_with_their_own_fp8_scales_each(tmp_path, monkeypatch):
    model, config = load_model(make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)[1])
    traced = []
    call = llama.Attention.__call__
    monkeypatch.setattr(llama.Attention, "__call__", lambda self, *args: traced.append(1) or call(self, *args))
    token_ids, positions, metadata, num_blocks = prompt_step([[5, 6, 7]], block_size=8)

    def trace() -> int:
        traced.clear()
        pool = init_kv_pool(config, num_blocks, 8, jnp.float32)
        model.hidden_states(token_ids, positions, pool, metadata, AttentionPlan("xla"))
        return len(traced)

    llama._decoder_layer.clear_cache()
    assert trace() == 1
    set_kv_scales(model, [(0.5, 0.25), (0.125, 1.0), (2.0, 4.0)])
    assert layer_kinds(model) == [0, 1, 2]
    assert trace() == 3
