"""The C++ 4-bit group matmul (kernels_cpu/packed_matmul.cc, CbjaxPackedMatmulQ4) and its jnp reference
against numpy in float64 on the dequantized weight q * scales + mins, and int4 quantization against the
`gguf` package's own Q4_0 and Q4_1 quantizers.

The bound is derived: a group's sum of x_k * q_k (q a small integer) rounds once per FMA, so it is off by
at most G * 2^-24 * sum|x q|; the scale and min FMAs, the group sum of x and the sum over groups add at most
2 * groups + 4 roundings more, so |error| <= (2G + 2 groups + 4) * 2^-24 * (|x| @ (q |scales| + |mins|))
(2G: the reference sums x in float32 too). Shapes cover rows 0, 1, short of a pass of 8 and a tail, 64 (decode),
K = G and many groups, N of 1, short of and past a panel."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest

from kernels_cpu import (
    pack_group_rows,
    pack_weight,
    packed_matmul_cpu,
    packed_matmul_reference,
    unpack_group_rows,
    unpack_weight,
)
from kernels_cpu.quant4 import dequantize_int4, int4_matmul, pack_nibbles, quantize_int4

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the kernel is an XLA:CPU custom call")

kernel = jax.jit(packed_matmul_cpu)
reference = jax.jit(packed_matmul_reference)
# rows, K, G, N
SHAPES = [(1, 32, 32, 32), (0, 64, 32, 33), (1, 576, 32, 960), (7, 128, 128, 31), (64, 256, 128, 100),
          (24, 384, 192, 40), (5, 512, 32, 1), ((2, 3), 64, 32, 40)]


def q4_product(rng: np.random.Generator, rows, k: int, group: int, n: int):
    """x, random nibbles, scales and mins (independent of any quantizer), x @ w in float64 and the bound."""
    x = rng.standard_normal((*np.atleast_1d(rows), k)).astype(np.float32)
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.1, (k // group, n)).astype(np.float32)
    mins = rng.uniform(-0.8, 0.1, (k // group, n)).astype(np.float32)
    w = q * np.repeat(scales.astype(np.float64), group, 0) + np.repeat(mins.astype(np.float64), group, 0)
    magnitude = q * np.repeat(np.abs(scales.astype(np.float64)), group, 0) + np.repeat(np.abs(mins), group, 0)
    bound = (2 * group + 2 * (k // group) + 4) * 2.0**-24 * (np.abs(x) @ magnitude) + 1e-30
    return x, pack_nibbles(q), scales, mins, x.astype(np.float64) @ w, bound


@pytest.mark.parametrize("rows,k,group,n", SHAPES)
def test_q4_kernel_and_its_reference_match_float64_within_the_derived_bound(rows, k, group, n):
    x, nibbles, scales, mins, expected, bound = q4_product(np.random.default_rng(), rows, k, group, n)
    packed = pack_weight(nibbles)
    assert packed.shape == (-(-n // 32), k // 2, 32) and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(unpack_weight(packed, n=n)), nibbles)
    for out in (kernel(x, packed, scales, mins), reference(x, packed, scales, mins), int4_matmul(x, nibbles, scales, mins)):
        out = np.asarray(out, np.float64)
        assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)


def grid_product(rng: np.random.Generator, rows, k: int, group: int, n: int):
    """As q4_product, with the nibbles indexing a random grid of 16 values of either sign (IQ4's kind: not 0..15)."""
    x, nibbles, scales, mins, _, _ = q4_product(rng, rows, k, group, n)
    grid = np.sort(rng.uniform(-127, 127, 16)).astype(np.float32)
    q = grid.astype(np.float64)[np.stack([nibbles & 0x0F, nibbles >> 4], 1).reshape(k, n)]
    w = q * np.repeat(scales.astype(np.float64), group, 0) + np.repeat(mins.astype(np.float64), group, 0)
    magnitude = np.abs(q) * np.repeat(np.abs(scales.astype(np.float64)), group, 0) + np.repeat(np.abs(mins), group, 0)
    bound = (2 * group + 2 * (k // group) + 4) * 2.0**-24 * (np.abs(x) @ magnitude) + 1e-30
    return x, nibbles, scales, mins, grid, x.astype(np.float64) @ w, bound


@pytest.mark.parametrize("rows,k,group,n", SHAPES)
def test_q4_kernel_on_a_grid_and_its_reference_match_float64_within_the_derived_bound(rows, k, group, n):
    """CbjaxPackedMatmulQ4Grid: w = scales * grid[q] + mins (the grid's values are not small integers, but each
    product x * grid[q] still rounds once per FMA, so the same bound holds over |grid[q]|)."""
    x, nibbles, scales, mins, grid, expected, bound = grid_product(np.random.default_rng(), rows, k, group, n)
    packed = pack_weight(nibbles)
    for out in (kernel(x, packed, scales, mins, grid), reference(x, packed, scales, mins, grid),
                int4_matmul(x, nibbles, scales, mins, grid)):
        out = np.asarray(out, np.float64)
        assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)
    # dequantize_int4 reads the grid too: the same float64 weight
    np.testing.assert_allclose(x.astype(np.float64) @ dequantize_int4(nibbles, scales, mins, grid), expected, rtol=1e-12,
                               atol=1e-12)


def test_the_identity_grid_gives_the_plain_kernels_sums_bit_for_bit_and_rows_stay_batch_invariant():
    """A grid of 0..15 is the plain 4-bit form: the same bits at one row and many; and on any grid each row of a
    64-row call equals that row alone."""
    rng = np.random.default_rng()
    x, nibbles, scales, mins, grid, _, _ = grid_product(rng, 64, 384, 32, 100)
    packed = pack_weight(nibbles)
    identity = np.arange(16, dtype=np.float32)
    for rows in (1, 64):
        np.testing.assert_array_equal(np.asarray(kernel(x[:rows], packed, scales, mins, identity)),
                                      np.asarray(kernel(x[:rows], packed, scales, mins)))
    whole = np.asarray(kernel(x, packed, scales, mins, grid))
    alone = np.stack([np.asarray(kernel(x[row : row + 1], packed, scales, mins, grid))[0] for row in range(64)])
    np.testing.assert_array_equal(alone, whole)
    with pytest.raises(ValueError, match=r"and grid \(15,\)"):
        packed_matmul_cpu(x, packed, scales, mins, grid[:15])


@pytest.mark.parametrize("rows,k,group,n", [(1, 576, 32, 960), (7, 128, 128, 64), (64, 256, 64, 96),
                                            ((2, 3), 64, 32, 32)])
def test_scales_and_mins_packed_by_panel_give_the_same_sums(rows, k, group, n):
    """Scales and mins packed by panel (pack_group_rows: the engine's form where N is whole panels, one stream
    per panel) are the same numbers read in the same order: the kernel's outputs equal those from [K / G, N]
    bit for bit, and the reference's are within the bound."""
    x, nibbles, scales, mins, expected, bound = q4_product(np.random.default_rng(), rows, k, group, n)
    packed = pack_weight(nibbles)
    by_panel = [pack_group_rows(a) for a in (scales, mins)]
    assert by_panel[0].shape == (n // 32, k // group, 32)
    np.testing.assert_array_equal(unpack_group_rows(by_panel[1]), mins)
    np.testing.assert_array_equal(np.asarray(kernel(x, packed, *by_panel)), np.asarray(kernel(x, packed, scales, mins)))
    out = np.asarray(reference(x, packed, *by_panel), np.float64)
    assert out.shape == expected.shape and np.all(np.abs(out - expected) <= bound)


def test_scales_pack_by_panel_only_for_whole_panels_and_must_match_the_nibbles():
    with pytest.raises(ValueError, match=r"with N a multiple of 32, got \(2, 40\)"):
        pack_group_rows(np.ones((2, 40), np.float32))
    x, nibbles, scales, mins, _, _ = q4_product(np.random.default_rng(), 2, 64, 32, 64)
    with pytest.raises(ValueError, match=r"packed weight uint8 \(2, 32, 32\) with scales \(3, 2, 32\)"):
        packed_matmul_cpu(x, pack_weight(nibbles), *(pack_group_rows(np.tile(a, 2)[:, :96]) for a in (scales, mins)))


@pytest.mark.parametrize("group", [32, 192])
def test_each_row_is_the_same_sum_whatever_the_batch(group):
    """A request's product does not depend on how many rows share its step or where it sits: each row of a
    64-row call (eight passes of 8 rows over each panel) equals, bit for bit, that row alone (a pass of one
    row) and that row at the head of a shorter batch (whose passes start elsewhere)."""
    x, nibbles, scales, mins, _, _ = q4_product(np.random.default_rng(), 64, 384, group, 70)
    packed = pack_weight(nibbles)
    whole = np.asarray(kernel(x, packed, scales, mins))
    alone = np.stack([np.asarray(kernel(x[row : row + 1], packed, scales, mins))[0] for row in range(64)])
    np.testing.assert_array_equal(alone, whole)
    for row in (3, 4, 18, 47):
        np.testing.assert_array_equal(np.asarray(kernel(x[row:], packed, scales, mins))[0], whole[row])


def test_int4_picks_per_group_at_least_as_well_as_ggufs_q4_0_and_q4_1():
    """At G = 32 the two roundings quantize_int4 chooses between are GGUF's Q4_0 (symmetric) and Q4_1
    (asymmetric); per group it keeps the better, so its total error is below both of gguf's own."""
    w = np.random.default_rng().standard_normal((256, 96)).astype(np.float32)
    nibbles, scales, mins = quantize_int4(w, group_size=32)
    ours = dequantize_int4(nibbles, scales, mins)
    rows = np.ascontiguousarray(w.T)  # GGUF blocks run along K within an output row
    theirs = {qtype.name: gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype).T
              for qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)}
    error = lambda approx: np.square(approx - w).sum()  # noqa: E731
    assert error(ours) < min(error(t) for t in theirs.values()), {name: error(t) for name, t in theirs.items()}
    # every weight within one step of its group (half a step, or a symmetric group's clipped end)
    assert np.all(np.abs(ours - w) <= np.repeat(np.abs(scales), 32, 0) * (1 + 1e-5))
    symmetric = np.isclose(mins, -8 * scales)
    assert symmetric.any() and not symmetric.all()  # both roundings win somewhere on normal weights


def test_a_group_size_that_does_not_divide_k_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"group size 128 does not divide the weight's input dim K=96"):
        quantize_int4(np.ones((96, 8), np.float32))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_int4(np.ones((128, 8), np.uint8))
