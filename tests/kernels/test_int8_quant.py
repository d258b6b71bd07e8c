"""int8 weight-only quantization (kernels_cpu/quant.py) against numpy in float64, with error bounds
derived from the scheme: rounding moves each weight by at most half its column's scale, and a
float32 dot of length K is off by at most K * 2^-24 * sum|x_k w_k| (the standard gamma_K bound)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.quantization import check_quantization
from kernels_cpu.quant import int8_matmul, quantize_int8
from kernels_pallas.lowering import lowering_target

SHAPES = [(1, 1, 1), (1, 33, 31), (3, 64, 32), (5, 96, 33), (7, 127, 65)]  # rows, K, N: rows 1, odd widths, panel edges


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_quantize_int8_rounds_each_weight_within_half_a_scale(rows, k, n):
    w = np.random.default_rng().normal(size=(k, n)).astype(np.float32)
    w[:, 0] = 0.0  # an all-zero column: scale 1, q 0
    q, scales = quantize_int8(w)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (n,)
    assert np.abs(q).max() <= 127 and np.all(scales > 0) and not q[:, 0].any()
    err = np.abs(q.astype(np.float64) * scales - w)
    # w / scale is divided in float32: |w / scale| <= 127 is off by at most 128 * 2^-24 before rint, so a
    # weight within that of a half step may round the far way (a random draw found one at 1e-6).
    assert np.all(err <= scales.astype(np.float64) * (0.5 + 128 * 2.0**-24))
    # The column's largest |w| maps to +-127 exactly: the scale is tight, not just an upper bound.
    assert np.all(np.abs(q[:, 1:]).max(axis=0) == 127)


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_int8_matmul_matches_float64_reference(rows, k, n):
    rng = np.random.default_rng()
    x = rng.normal(size=(rows, k)).astype(np.float32)
    q, scales = quantize_int8(rng.normal(size=(k, n)).astype(np.float32))
    w = q.astype(np.float64) * scales.astype(np.float64)
    y = np.asarray(jax.jit(int8_matmul)(x, q, scales), np.float64)
    expected = x.astype(np.float64) @ w
    # float32 accumulation over K, plus the final scale multiply (one rounding each).
    bound = (k + 2) * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-30
    assert y.shape == (rows, n) and np.all(np.abs(y - expected) <= bound)


@pytest.mark.parametrize("rows,k,group,n", [(1, 32, 32, 31), (3, 64, 16, 32), (5, 96, 32, 33)])
def test_int8_matmul_with_group_scales_matches_float64_reference(rows, k, group, n):
    """Scales [K / G, N]: w[k, n] = q[k, n] * scales[k // G, n]. Each group's float32 sum is off by at most
    (G + 1) * 2^-24 of its sum|x w| (+1: a product may round), its scale multiply once, adding the groups
    groups - 1 times more."""
    rng = np.random.default_rng()
    x = rng.normal(size=(rows, k)).astype(np.float32)
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scales = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(scales.astype(np.float64), group, 0)
    y = np.asarray(jax.jit(int8_matmul)(x, q, scales), np.float64)
    bound = (group + k // group + 2) * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-30
    assert y.shape == (rows, n) and np.all(np.abs(y - x.astype(np.float64) @ w) <= bound)


def test_int8_matmul_error_against_float_weights_is_bounded_by_half_scales():
    rng = np.random.default_rng()
    x = rng.normal(size=(4, 256)).astype(np.float32)
    w = rng.normal(size=(256, 96)).astype(np.float32)
    q, scales = quantize_int8(w)
    y = np.asarray(int8_matmul(x, q, scales), np.float64)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = np.abs(x).sum(axis=1, keepdims=True) * scales / 2 + 258 * 2.0**-24 * (np.abs(x) @ np.abs(w)) * 2
    assert np.all(np.abs(y - exact) <= bound)


def test_already_quantized_and_unknown_names_are_refused():
    q, _ = quantize_int8(np.ones((4, 4), np.float32))
    with pytest.raises(ValueError, match="int8.*already quantized"):
        quantize_int8(q)
    with pytest.raises(ValueError, match=r"'fp4'.*\('int8', 'int4', 'int4-g64', 'int4-g32'\)"):
        check_quantization("fp4")
    check_quantization(None)
    check_quantization("int8")
    with pytest.raises(ValueError, match="does not match"):
        int8_matmul(jnp.ones((1, 8)), jnp.ones((4, 4), jnp.int8), jnp.ones(4))
    with pytest.raises(ValueError, match="3 groups, and 3 does not divide the weight's input dim K=8"):
        int8_matmul(jnp.ones((1, 8)), jnp.ones((8, 4), jnp.int8), jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=r"and mins \(4,\) .*mins only beside \[K / G, N\] scales"):
        int8_matmul(jnp.ones((1, 8)), jnp.ones((8, 4), jnp.int8), jnp.ones(4), jnp.ones(4))


@pytest.mark.parametrize("scales_shape,with_mins", [((96,), False), ((4, 96), False), ((4, 96), True)],
                         ids=["per-column", "groups-of-32", "groups-of-32-with-mins"])
def test_int8_matmul_lowers_for_cuda_with_int8_weights(scales_shape, with_mins):
    x = jax.ShapeDtypeStruct((8, 128), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((128, 96), jnp.int8)
    s = jax.ShapeDtypeStruct(scales_shape, jnp.float32)
    with lowering_target("cuda"):
        text = jax.jit(int8_matmul).trace(x, q, s, *[s] * with_mins).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<128x96xi8>" in text  # the weight crosses into the step as int8, not a float copy
