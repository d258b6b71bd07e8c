"""The C++ matmul over int8 panels with float32 scales (kernels_cpu/packed_matmul.cc, CbjaxPackedMatmulI8)
against numpy in float64 on the dequantized weight q * scales. The bound is derived, as in
test_int8_quant.py: each product x * q is exact in a float32 FMA, K sums of rounded adds are off by at
most K * 2^-24 * sum|x q|, and the scale multiply rounds once more, so (K + 2) * 2^-24 * (|x| @ |w|).
Sizes cover rows 0, 1, one short of, at and past a pass of rows, K of 1 and odd, and N of 1, one short
of and past a panel (the int8 panels are padded, unlike float32's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu import pack_weight, packable, packed_matmul_cpu, packed_matmul_reference, unpack_weight
from kernels_cpu.quant import quantize_int8

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the kernel is an XLA:CPU custom call")

kernel = jax.jit(packed_matmul_cpu)
SHAPES = [(1, 1, 1), (0, 5, 33), (1, 576, 960), (7, 33, 31), (9, 127, 65), (17, 300, 96), ((2, 3), 64, 40)]


def int8_product(rng: np.random.Generator, rows: int | tuple[int, ...], k: int, n: int):
    """x (float32), int8 q and scales of a random weight, x @ (q * scales) in float64 and its error bound."""
    x = rng.standard_normal((*np.atleast_1d(rows), k)).astype(np.float32)
    q, scales = quantize_int8(rng.standard_normal((k, n)).astype(np.float32))
    w = q.astype(np.float64) * scales.astype(np.float64)
    return x, q, scales, x.astype(np.float64) @ w, (k + 2) * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-30


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_int8_kernel_and_its_reference_match_float64_within_the_derived_bound(rows, k, n):
    x, q, scales, expected, bound = int8_product(np.random.default_rng(), rows, k, n)
    packed = pack_weight(q)
    assert packed.shape == (-(-n // 32), k, 32) and packed.dtype == np.int8
    for out in (kernel(x, packed, scales), packed_matmul_reference(x, packed, scales)):
        out = np.asarray(out, np.float64)
        assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)


def test_each_row_is_the_same_sum_whatever_the_batch():
    """A request's product does not depend on how many rows share its step or where it sits."""
    x, q, scales, _, _ = int8_product(np.random.default_rng(), 19, 384, 100)
    packed = pack_weight(q)
    whole = np.asarray(kernel(x, packed, scales))
    for row in (0, 7, 8, 18):
        np.testing.assert_array_equal(np.asarray(kernel(x[row : row + 1], packed, scales))[0], whole[row])
        np.testing.assert_array_equal(np.asarray(kernel(x[row:], packed, scales))[0], whole[row])


def test_int8_packing_pads_the_last_panel_and_mismatched_scales_are_refused():
    q = np.arange(-35, 35, dtype=np.int8).reshape(2, 35)
    packed = pack_weight(q)
    assert packable((2, 35), np.int8) and packed.shape == (2, 2, 32)
    np.testing.assert_array_equal(packed[1, :, :3], q[:, 32:])
    assert not packed[1, :, 3:].any()  # zero columns after N
    np.testing.assert_array_equal(np.asarray(unpack_weight(jnp.asarray(packed), n=35)), q)
    with pytest.raises(ValueError, match=r"int8 \(2, 2, 32\) with scales \(31,\)"):
        packed_matmul_cpu(jnp.zeros((1, 2)), jnp.asarray(packed), jnp.ones(31))
    with pytest.raises(ValueError, match="with scales None"):
        packed_matmul_cpu(jnp.zeros((1, 2)), jnp.asarray(packed))
