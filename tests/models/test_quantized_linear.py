"""The int8 Linear (cbjax/models/layers/linear.py) against the float layer it was quantized from: each
output is off by at most half its column's scale times sum|x| (rounding), plus float32 slack."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbjax.models.layers.linear import linear, quantize_linears


def test_int8_linear_is_within_half_a_scale_of_the_float_layer():
    rng = np.random.default_rng()
    layer = linear(48, 40, use_bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    w = np.asarray(layer.kernel[...])
    bias = rng.normal(size=40).astype(np.float32)
    layer.bias[...] = bias
    x = rng.normal(size=(3, 48)).astype(np.float32)
    params = quantize_linears({"model.layers.0.mlp.down_proj.kernel": w, "model.embed_tokens.embedding": w}, "int8")
    assert params["model.embed_tokens.embedding"] is w  # embeddings stay float
    q, scales = params["model.layers.0.mlp.down_proj.kernel"], params["model.layers.0.mlp.down_proj.scales"]
    layer.kernel = nnx.Param(jnp.asarray(q))
    layer.scales = nnx.Param(jnp.asarray(scales))
    y = np.asarray(layer(jnp.asarray(x)), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64) + bias
    bound = np.abs(x).sum(axis=1, keepdims=True) * scales / 2 + 60 * 2.0**-24 * (np.abs(x) @ np.abs(w) + np.abs(bias))
    assert q.dtype == np.int8 and np.all(np.abs(y - exact) <= bound)
    # And exactly the dequantized weight's product, to float32 accumulation (catches a wrong scale).
    dequantized = q.astype(np.float64) * scales
    exact_q = x.astype(np.float64) @ dequantized + bias
    assert np.all(np.abs(y - exact_q) <= 60 * 2.0**-24 * (np.abs(x) @ np.abs(dequantized) + np.abs(bias)))


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="'int3'"):
        quantize_linears({}, "int3")


def test_an_int4_group_that_does_not_divide_a_width_is_refused_naming_the_names_that_fit():
    with pytest.raises(ValueError, match=r"quantization='int4' quantizes groups of 128 inputs, which do not divide the "
                                         r"576 inputs of model.layers.0.mlp.down_proj.kernel; .*\['int4-g64', 'int4-g32'\]"):
        quantize_linears({"model.layers.0.mlp.down_proj.kernel": np.zeros((576, 8), np.float32)}, "int4")
    params = quantize_linears({"model.layers.0.mlp.down_proj.kernel": np.zeros((576, 8), np.float32)}, "int4-g64")
    assert params["model.layers.0.mlp.down_proj.mins"].shape == (576 // 64, 8)


@pytest.mark.parametrize("quantization", ["int8", "int4-g32"])
@pytest.mark.parametrize("pack", [False, True])
def test_a_quantized_model_counts_as_the_float_model_it_stands_for(quantization, pack):
    """The CPU KV pool is sized from the model's float bytes (core/kv/sizing.py): quantizing the projections (or
    the tied embedding-head, `lm_head`) must not shrink it. Before, an int8 engine got 0.4x float32's pool and
    preempted at 64 sequences."""
    from cbjax.models.layers.linear import float_equivalent_bytes

    rng = np.random.default_rng(0)
    float_params = {"model.layers.0.mlp.down_proj.kernel": rng.normal(size=(96, 64)).astype(np.float32),
                    "model.layers.0.self_attn.qkv_proj.kernel": rng.normal(size=(64, 160)).astype(np.float32),
                    "model.embed_tokens.embedding": rng.normal(size=(100, 64)).astype(np.float32),
                    "model.norm.scale": np.ones(64, np.float32)}
    want = sum(array.nbytes for array in float_params.values())
    params = quantize_linears(dict(float_params), quantization, pack=pack, lm_head=True)
    assert params["model.layers.0.mlp.down_proj.kernel"].dtype != np.float32  # quantized, really
    assert params["model.embed_tokens.embedding"].dtype != np.float32
    assert sum(np.asarray(a).nbytes for a in params.values()) < want / 2
    assert float_equivalent_bytes(params, jnp.float32) == want
    assert float_equivalent_bytes(params, jnp.bfloat16) == want - sum(
        float_params[n].nbytes // 2 for n in float_params if n != "model.norm.scale")
