"""quantize_lm_head (loader.load_model, linear.quantize_linears): the LM head, or a tied model's embedding kept
as that head's kernel, quantized with `quantization`'s scheme. Against the same model with a float head: each
int8 logit is off by at most half its vocabulary row's scale times sum |x| (x the normed hidden state), and
greedy picks agree where the float margin is wider than that."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_gguf_import import write_tiny_llama_gguf

from cbjax.checkpoint.convert import convert_checkpoint
from cbjax.checkpoint.gguf_import import import_gguf
from cbjax.checkpoint.loader import load_model
from cbjax.config import EngineConfig


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_int8_lm_head_is_within_half_a_scale_of_the_float_head(tmp_path, tied, packed):
    write_tiny_llama_gguf(tmp_path / "tiny.gguf", tied=tied)
    checkpoint = convert_checkpoint(import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf"), tmp_path / "float")
    float_head, _ = load_model(checkpoint, quantization="int8", pack_for_cpu=packed, fused_projections=True)
    int8_head, _ = load_model(checkpoint, quantization="int8", pack_for_cpu=packed, fused_projections=True,
                              quantize_lm_head=True)
    head = int8_head.model.embed_tokens if tied else int8_head.lm_head
    assert (head.embedding if tied else head.kernel)[...].dtype == jnp.int8
    tokens = jnp.asarray(np.random.default_rng().integers(3, 250, 12))
    rows = float_head.embed(tokens)  # any rows of the head's input width, the same into both heads
    hidden = float_head.model.norm(rows)
    want = np.asarray(float_head.compute_logits(rows), np.float64)
    got = np.asarray(int8_head.compute_logits(rows), np.float64)
    scales = np.asarray(head.scales[...], np.float64)
    bound = np.abs(np.asarray(hidden, np.float64)).sum(axis=1, keepdims=True) * scales / 2 + 1e-4 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= bound)
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * bound.max(axis=1)
    assert (got.argmax(1) == want.argmax(1))[clear].all()


def test_quantize_lm_head_without_quantization_is_refused():
    with pytest.raises(ValueError, match="quantize_lm_head=True .* quantization is None; set quantization"):
        EngineConfig(model="m", quantize_lm_head=True)
