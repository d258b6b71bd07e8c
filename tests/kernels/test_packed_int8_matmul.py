"""The C++ matmul over int8 panels (kernels_cpu/packed_matmul.cc, CbjaxPackedMatmulI8) with float32 scales
per column [N] or per group of G inputs [K / G, N], and its jnp reference, against numpy in float64 on the
dequantized weight q * scales. The bounds are derived, as in test_int8_quant.py. Per column: each product
x * q is exact in a float32 FMA, K sums of rounded adds are off by at most K * 2^-24 * sum|x q|, and the
scale multiply rounds once more, so (K + 2) * 2^-24 * (|x| @ |w|). Per group: a group's sum is off by at
most (G + 1) * 2^-24 of its sum|x q| (+1: the reference's dot may round each product), its scale multiply
rounds once and adding the groups `groups` - 1 times more, so (G + groups + 2) * 2^-24 * (|x| @ |w|).
Sizes cover rows 0, 1, one short of, at and past a pass of rows, 16 and 64 (passes of 8 rows over each
panel), K of 1 and odd, K = G and G of 16, 32, 96, and N of 1, one short of and past a panel (the int8 panels are padded, unlike float32's).
With mins [K / G, N] (CbjaxPackedMatmulI8Mins: w = q * scales + mins per group) each group adds its sum of x
(summed in double, rounded once) times its mins in one more FMA: two more roundings of terms no larger than
|x| @ |mins|, so the bound is taken over |q * scales| + |mins| with (G + groups + 4) * 2^-24.
fp8 (e4m3fn) panels (CbjaxPackedMatmulF8: a checkpoint's fp8 weights as stored) are read as int8 ones, each code
widened exactly (a product x * q is still exact in an FMA), so the same bounds hold, on codes drawn from all 254
finite ones (subnormals included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_cpu import pack_weight, packable, packed_matmul_cpu, packed_matmul_reference, unpack_weight
from kernels_cpu.quant import int8_matmul, quantize_int8

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the kernel is an XLA:CPU custom call")

kernel = jax.jit(packed_matmul_cpu)
SHAPES = [(1, 1, 1), (0, 5, 33), (1, 576, 960), (7, 33, 31), (9, 127, 65), (17, 300, 96), (29, 200, 45),
          (64, 384, 70), ((2, 3), 64, 40)]
# rows, K, G, N
GROUP_SHAPES = [(1, 32, 32, 32), (0, 64, 32, 33), (1, 576, 32, 960), (7, 96, 16, 31), (9, 128, 32, 65),
                (16, 256, 16, 96), (29, 128, 32, 45), (64, 512, 32, 100), (24, 384, 96, 70), ((2, 3), 64, 32, 40)]


def int8_product(rng: np.random.Generator, rows: int | tuple[int, ...], k: int, n: int):
    """x (float32), int8 q and scales of a random weight, x @ (q * scales) in float64 and its error bound."""
    x = rng.standard_normal((*np.atleast_1d(rows), k)).astype(np.float32)
    q, scales = quantize_int8(rng.standard_normal((k, n)).astype(np.float32))
    w = q.astype(np.float64) * scales.astype(np.float64)
    return x, q, scales, x.astype(np.float64) @ w, (k + 2) * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-30


def int8_group_product(rng: np.random.Generator, rows: int | tuple[int, ...], k: int, group: int, n: int):
    """x, random int8 q and group scales [K / G, N] of either sign (independent of any quantizer),
    x @ (q * scales) in float64 and its error bound."""
    x = rng.standard_normal((*np.atleast_1d(rows), k)).astype(np.float32)
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scales = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(scales.astype(np.float64), group, 0)
    bound = (group + k // group + 2) * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-30
    return x, q, scales, x.astype(np.float64) @ w, bound


def int8_mins_product(rng: np.random.Generator, rows: int | tuple[int, ...], k: int, group: int, n: int):
    """x, random int8 q of 0..31 (a 5-bit GGUF block's integers), group scales and mins [K / G, N] of either sign,
    x @ (q * scales + mins) in float64 and its error bound."""
    x = rng.standard_normal((*np.atleast_1d(rows), k)).astype(np.float32)
    q = rng.integers(0, 32, (k, n)).astype(np.int8)
    scales, mins = (rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32) for _ in range(2))
    scaled, offsets = (q.astype(np.float64) * np.repeat(scales.astype(np.float64), group, 0),
                       np.repeat(mins.astype(np.float64), group, 0))
    bound = (group + k // group + 4) * 2.0**-24 * (np.abs(x) @ (np.abs(scaled) + np.abs(offsets))) + 1e-30
    return x, q, scales, mins, x.astype(np.float64) @ (scaled + offsets), bound


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_int8_kernel_and_its_reference_match_float64_within_the_derived_bound(rows, k, n):
    x, q, scales, expected, bound = int8_product(np.random.default_rng(), rows, k, n)
    packed = pack_weight(q)
    assert packed.shape == (-(-n // 32), k, 32) and packed.dtype == np.int8
    for out in (kernel(x, packed, scales), packed_matmul_reference(x, packed, scales)):
        out = np.asarray(out, np.float64)
        assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)


@pytest.mark.parametrize("rows,k,group,n", GROUP_SHAPES)
def test_int8_group_kernel_and_its_references_match_float64_within_the_derived_bound(rows, k, group, n):
    x, q, scales, expected, bound = int8_group_product(np.random.default_rng(), rows, k, group, n)
    packed = pack_weight(q)
    for out in (kernel(x, packed, scales), packed_matmul_reference(x, packed, scales), jax.jit(int8_matmul)(x, q, scales)):
        out = np.asarray(out, np.float64)
        assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)


@pytest.mark.parametrize("rows,k,group,n", GROUP_SHAPES)
def test_int8_kernel_with_mins_and_its_references_match_float64_within_the_derived_bound(rows, k, group, n):
    x, q, scales, mins, expected, bound = int8_mins_product(np.random.default_rng(), rows, k, group, n)
    packed = pack_weight(q)
    for out in (kernel(x, packed, scales, mins), packed_matmul_reference(x, packed, scales, mins),
                jax.jit(int8_matmul)(x, q, scales, mins)):
        out = np.asarray(out, np.float64)
        assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)


def test_zero_mins_add_exact_zeros_to_the_int8_kernels_sums():
    """Mins of zero change nothing: the sums with them are the sums without, bit for bit (x * 0 + y is y)."""
    x, q, scales, _, _ = int8_group_product(np.random.default_rng(), 19, 96, 32, 40)
    packed = pack_weight(q)
    np.testing.assert_array_equal(np.asarray(kernel(x, packed, scales, np.zeros_like(scales))),
                                  np.asarray(kernel(x, packed, scales)))


def test_per_column_scales_are_the_one_group_case_bit_for_bit():
    """scales [N] and the same scales as [1, N] run the same sums: equal bits, at one row and many."""
    x, q, scales, _, _ = int8_product(np.random.default_rng(), 19, 96, 40)
    packed = pack_weight(q)
    for rows in (1, 19):
        np.testing.assert_array_equal(np.asarray(kernel(x[:rows], packed, scales)),
                                      np.asarray(kernel(x[:rows], packed, scales[None])))


@pytest.mark.parametrize("group,with_mins", [(None, False), (32, False), (96, False), (32, True)],
                         ids=["per-column", "groups-of-32", "groups-of-96", "groups-of-32-with-mins"])
def test_each_row_is_the_same_sum_whatever_the_batch(group, with_mins):
    """A request's product does not depend on how many rows share its step or where it sits: each row of a
    64-row call (eight passes of 8 rows over each panel) equals, bit for bit, that row alone (a pass of one
    row) and that row at the head of a shorter batch (whose passes start elsewhere)."""
    rng = np.random.default_rng()
    mins = ()
    if group is None:
        x, q, scales, _, _ = int8_product(rng, 64, 384, 100)
    elif with_mins:
        x, q, scales, *mins, _, _ = int8_mins_product(rng, 64, 384, group, 100)
    else:
        x, q, scales, _, _ = int8_group_product(rng, 64, 384, group, 100)
    packed = pack_weight(q)
    whole = np.asarray(kernel(x, packed, scales, *mins))
    alone = np.stack([np.asarray(kernel(x[row : row + 1], packed, scales, *mins))[0] for row in range(64)])
    np.testing.assert_array_equal(alone, whole)
    for row in (7, 8, 18, 47):
        np.testing.assert_array_equal(np.asarray(kernel(x[row:], packed, scales, *mins))[0], whole[row])


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
    with pytest.raises(ValueError, match=r"with scales \(1, 2, 35\)"):
        packed_matmul_cpu(jnp.zeros((1, 2)), jnp.asarray(packed), jnp.ones((1, 2, 35)))
    with pytest.raises(ValueError, match=r"with scales \(35,\) and mins \(35,\)"):  # mins need grouped scales
        packed_matmul_cpu(jnp.zeros((1, 2)), jnp.asarray(packed), jnp.ones(35), jnp.zeros(35))
    with pytest.raises(ValueError, match=r"with scales \(1, 35\) and mins \(2, 35\)"):
        packed_matmul_cpu(jnp.zeros((1, 2)), jnp.asarray(packed), jnp.ones((1, 35)), jnp.zeros((2, 35)))


def test_a_group_count_that_does_not_divide_k_is_refused_naming_both():
    packed = jnp.asarray(pack_weight(np.ones((96, 40), np.int8)))
    for groups in (5, 0):
        with pytest.raises(ValueError, match=rf"{groups} groups, and {groups} does not divide the weight's input dim K=96"):
            packed_matmul_cpu(jnp.zeros((1, 96)), packed, jnp.ones((groups, 40)))


def fp8_product(rng: np.random.Generator, rows, k: int, group: int | None, n: int):
    """x, random e4m3 codes (every finite one, subnormals included; not the NaN codes) and scales [N] or [K / G, N],
    x @ (q * scales) in float64 and the int8 kernels' bound."""
    x = rng.standard_normal((*np.atleast_1d(rows), k)).astype(np.float32)
    codes = rng.integers(0, 256, (k, n)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    q = codes.view(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(-0.1, 0.1, (n,) if group is None else (k // group, n)).astype(np.float32)
    w = q.astype(np.float64) * (scales.astype(np.float64) if group is None else np.repeat(scales.astype(np.float64), group, 0))
    terms = k + 2 if group is None else group + k // group + 2
    return x, q, scales, x.astype(np.float64) @ w, terms * 2.0**-24 * (np.abs(x) @ np.abs(w)) + 1e-30


@pytest.mark.parametrize("rows,k,group,n", [(rows, k, None, n) for rows, k, n in SHAPES] + GROUP_SHAPES)
def test_fp8_kernel_and_its_references_match_float64_within_the_int8_bound(rows, k, group, n):
    x, q, scales, expected, bound = fp8_product(np.random.default_rng(), rows, k, group, n)
    packed = pack_weight(q)
    assert packed.dtype == jnp.float8_e4m3fn and packed.shape == (-(-n // 32), k, 32)
    for out in (kernel(x, packed, scales), packed_matmul_reference(x, packed, scales), jax.jit(int8_matmul)(x, q, scales)):
        out = np.asarray(out, np.float64)
        assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)


def test_fp8_rows_are_the_same_sums_whatever_the_batch_and_every_code_widens_exactly():
    """Each row of a 64-row fp8 call equals that row alone, bit for bit; and with x one-hot and scales 1 the kernel
    returns the weights themselves: each of the 254 finite codes exactly its ml_dtypes value."""
    x, q, scales, _, _ = fp8_product(np.random.default_rng(), 64, 384, 32, 100)
    packed = pack_weight(q)
    whole = np.asarray(kernel(x, packed, scales))
    alone = np.stack([np.asarray(kernel(x[row : row + 1], packed, scales))[0] for row in range(64)])
    np.testing.assert_array_equal(alone, whole)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8).reshape(2, 127)
    q = codes.view(ml_dtypes.float8_e4m3fn)
    out = np.asarray(kernel(np.eye(2, dtype=np.float32), pack_weight(q), np.ones(127, np.float32)))
    np.testing.assert_array_equal(out, q.astype(np.float32))
