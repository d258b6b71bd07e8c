"""4-bit group-wise weights, one form for every 4-bit scheme: w[k, n] = scales[g, n] * q[k, n] + mins[g, n]
with q in 0..15 and g = k // G (groups of G consecutive inputs per output column). GGUF's Q4_0, Q4_1 and
Q4_K map onto it exactly (cbjax/checkpoint/gguf_q4.py); `quantize_int4` makes it from any float weight
(quantization="int4"). A form may also carry a grid [16]: w = scales * grid[q] + mins, the nibbles indexing 16
given values (GGUF's IQ4_NL and IQ4_XS, a non-linear grid, with mins 0). q is stored as nibbles u8 [K / 2, N]:
byte (s, n) holds q[2s, n] in its low nibble and q[2s + 1, n] in its high one; kernels_cpu.pack_weight cuts that into 32-column panels.

The product never makes float weights: y[n] = sum_g scales[g, n] * (sum_{k in g} x_k q[k, n])
+ mins[g, n] * (sum_{k in g} x_k), the C++ kernel's sum and `int4_matmul`'s (its jnp form, any platform).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

INT4_GROUP_SIZE = 128  # quantization="int4"'s group, as AWQ/GPTQ checkpoints and vLLM use
Q4_MAX = 15


def check_group_size(k: int, group_size: int) -> None:
    """Raise naming both unless `group_size` is even and divides the input dim `k`."""
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(
            f"4-bit group size {group_size} does not divide the weight's input dim K={k} (or is odd); "
            f"use an even group size that divides {k}"
        )


def pack_nibbles(q: UInt8[np.ndarray, "k n"]) -> UInt8[np.ndarray, "k2 n"]:
    """q [K, N] (0..15, K even) -> nibbles [K / 2, N]: rows 2s and 2s + 1 share byte row s (low, high)."""
    q = np.asarray(q, np.uint8)
    return q[0::2] | (q[1::2] << 4)


def unpack_nibbles(nibbles: UInt8[Array, "k2 n"]) -> UInt8[Array, "k n"]:
    """pack_nibbles' inverse (numpy or jnp)."""
    xp = jnp if isinstance(nibbles, jnp.ndarray) else np
    return xp.stack([nibbles & 0x0F, nibbles >> 4], axis=1).reshape(2 * nibbles.shape[0], nibbles.shape[1])


def dequantize_int4(
    nibbles: UInt8[np.ndarray, "k2 n"], scales: Float[np.ndarray, "g n"], mins: Float[np.ndarray, "g n"],
    grid: Float[np.ndarray, "16"] | None = None,
) -> Float[np.ndarray, "k n"]:
    """The float64 weight [K, N] the 4-bit form stands for (its nibbles indexing `grid` if given)."""
    q = unpack_nibbles(np.asarray(nibbles))
    q = q.astype(np.float64) if grid is None else np.asarray(grid, np.float64)[q]
    group = q.shape[0] // scales.shape[0]
    return q * np.repeat(np.asarray(scales, np.float64), group, 0) + np.repeat(np.asarray(mins, np.float64), group, 0)


def quantize_int4(
    w: Float[np.ndarray, "k n"], group_size: int = INT4_GROUP_SIZE,
) -> tuple[UInt8[np.ndarray, "k2 n"], Float[np.ndarray, "g n"], Float[np.ndarray, "g n"]]:
    """A float [K, N] weight -> (nibbles [K / 2, N], float32 scales and mins [K / G, N]).

    Each group takes whichever of two roundings has the smaller squared error, measured: asymmetric
    (min and max of the group on the grid's ends, Q4_1's) or symmetric (the largest |w| on one end,
    q - 8 about zero, Q4_0's), which wins where the group is centred on zero. A constant group gets scale 1."""
    w = np.asarray(w)
    if w.ndim != 2 or not (np.issubdtype(w.dtype, np.floating) or w.dtype == jnp.bfloat16):
        raise ValueError(
            f"quantize_int4 takes a float [K, N] weight, got {w.dtype} {w.shape}: a weight that is already "
            f"quantized (int8/int4, or a GGUF tensor kept as stored) cannot be quantized again; load the float checkpoint"
        )
    k, n = w.shape
    check_group_size(k, group_size)
    groups = w.astype(np.float32).reshape(k // group_size, group_size, n)
    low, high = groups.min(axis=1), groups.max(axis=1)
    peak = np.where(np.abs(high) >= np.abs(low), high, low)
    candidates = []
    for scale, offset in (((high - low) / Q4_MAX, low), (peak / -8, peak)):  # asymmetric, symmetric (min = -8 d)
        scale = np.where(scale != 0, scale, 1.0).astype(np.float32)
        offset = offset.astype(np.float32)
        q = np.clip(np.rint((groups - offset[:, None]) / scale[:, None]), 0, Q4_MAX)
        error = np.square(q * scale[:, None] + offset[:, None] - groups).sum(axis=1)
        candidates.append((q, scale, offset, error))
    (q_a, scale_a, min_a, error_a), (q_s, scale_s, min_s, error_s) = candidates
    symmetric = error_s < error_a
    q = np.where(symmetric[:, None], q_s, q_a).astype(np.uint8).reshape(k, n)
    return pack_nibbles(q), np.where(symmetric, scale_s, scale_a), np.where(symmetric, min_s, min_a)


def int4_matmul(
    x: Float[Array, "*rows k"], nibbles: UInt8[Array, "k2 n"], scales: Float[Array, "g n"], mins: Float[Array, "g n"],
    grid: Float[Array, "16"] | None = None,
) -> Float[Array, "*rows n"]:
    """x @ w of the 4-bit form (its nibbles indexing `grid` if given), per group as the C++ kernel sums it,
    accumulated in float32 (any platform)."""
    k, (groups, n) = x.shape[-1], scales.shape
    if (nibbles.dtype != jnp.uint8 or nibbles.shape != (k // 2, n) or mins.shape != scales.shape or groups == 0
            or (grid is not None and grid.shape != (16,))):
        raise ValueError(
            f"int4_matmul: x {x.shape} does not match 4-bit nibbles {nibbles.dtype} {nibbles.shape}, scales "
            f"{scales.shape}, mins {mins.shape}, grid {None if grid is None else grid.shape} (uint8 [K / 2, N], "
            f"float32 [K / G, N] both, a grid of 16 or none, x [..., K])"
        )
    check_group_size(k, k // groups)
    x_groups = x.astype(jnp.float32).reshape(*x.shape[:-1], groups, k // groups)
    q = unpack_nibbles(nibbles)
    q = (q.astype(jnp.float32) if grid is None else grid.astype(jnp.float32)[q]).reshape(groups, k // groups, n)
    sums = jnp.einsum("...gk,gkn->...gn", x_groups, q, preferred_element_type=jnp.float32)
    return (sums * scales).sum(axis=-2) + x_groups.sum(axis=-1) @ mins
