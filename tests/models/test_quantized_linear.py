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
