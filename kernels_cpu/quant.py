"""Weight-only int8 quantization (issue 38): symmetric, per output channel, float32 scales.

A float [K, N] weight becomes int8 q [K, N] and scales [N] with w ~= q * scales: each column's
scale is its largest |w| / 127, so every element is off by at most half its column's scale. The
product x @ w is (x @ q) * scales: the scale multiplies the N outputs, not the K*N weights, so
no float copy of the weight is made (XLA fuses the int8 -> float convert into the dot). This is
the jnp path every platform runs (and the one `cuda` lowers); vLLM's and torchao's int8
weight-only scheme is the same.

int8 weights may also carry one scale per group of G consecutive inputs: scales [K / G, N] with
w[k, n] = q[k, n] * scales[k // G, n] (GGUF's Q8_0 is G = 32; Q6_K's 6-bit values with their
16-input sub-block scales fit it at G = 16). The per-column form is the one-group case, G = K. Grouped
int8 weights may carry mins [K / G, N] too, w[k, n] = q[k, n] * scales[k // G, n] + mins[k // G, n]: GGUF's
types with a minimum (Q5_1, Q5_K, Q2_K) and fused kernels whose parts differ in type (checkpoint/gguf_forms.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8, Shaped

INT8_MAX = 127
# The q that int8_matmul multiplies by scales: int8, or fp8 (e4m3fn) codes, a checkpoint's fp8 weights as stored.
SCALED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def quantize_int8(w: Float[np.ndarray, "k n"]) -> tuple[Int8[np.ndarray, "k n"], Float[np.ndarray, " n"]]:
    """A float [K, N] weight -> (int8 q [K, N], float32 scales [N]), w ~= q * scales per column.
    An all-zero column gets scale 1 (q is 0 there), so no scale is 0."""
    w = np.asarray(w)
    if w.ndim != 2 or not (np.issubdtype(w.dtype, np.floating) or w.dtype == jnp.bfloat16):
        raise ValueError(
            f"quantize_int8 takes a float [K, N] weight, got {w.dtype} {w.shape}: a weight that is already "
            f"quantized (int8/int4, or a GGUF tensor kept as stored) cannot be quantized again; load the float checkpoint"
        )
    w = w.astype(np.float32)
    peak = np.abs(w).max(axis=0)
    scales = np.where(peak > 0, peak / INT8_MAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scales), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scales


def check_int8_groups(k: int, groups: int) -> None:
    """Raise naming both unless `groups` (the rows of int8 scales [K / G, N]) divides the input dim `k`."""
    if groups <= 0 or k % groups:
        raise ValueError(
            f"int8 scales have {groups} groups, and {groups} does not divide the weight's input dim K={k}; "
            f"give scales [K / G, N] for a group size G that divides {k}, or [N] for one scale per column"
        )


def int8_matmul(
    x: Float[Array, "*rows k"], q: Int8[Array, "k n"] | Shaped[Array, "k n"], scales: Float[Array, "*g n"], mins: Float[Array, "g n"] | None = None,
) -> Float[Array, "*rows n"]:
    """x @ (q * scales (+ mins)), accumulated in float32 (any platform). Scales [N]: (x @ q) * scales. Scales
    [K / G, N]: each group's sum of x * q times that group's scales, added over the groups, as the C++
    kernel sums them (q may be fp8, a checkpoint's weights as stored: widened exactly as int8 is); with mins [K / G, N] (w = q * scales + mins per group: GGUF's Q5_1, Q5_K, Q2_K) plus each
    group's sum of x times its mins (quant4.int4_matmul's form)."""
    if (q.ndim != 2 or q.dtype not in SCALED_DTYPES or scales.ndim not in (1, 2) or scales.shape[-1] != q.shape[1]
            or x.shape[-1] != q.shape[0] or (mins is not None and (scales.ndim != 2 or mins.shape != scales.shape))):
        raise ValueError(
            f"int8_matmul: x {x.shape} does not match an int8 weight {q.dtype} {q.shape} with scales {scales.shape} "
            f"and mins {None if mins is None else mins.shape} (int8 or float8_e4m3fn [K, N], float32 scales [N] or [K / G, N], "
            f"mins only beside [K / G, N] scales and of their shape, x [..., K])"
        )
    if scales.ndim == 1:
        y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32)
        return y * scales.astype(jnp.float32)
    (k, n), groups = q.shape, scales.shape[0]
    check_int8_groups(k, groups)
    x_groups = x.astype(jnp.float32).reshape(*x.shape[:-1], groups, k // groups)
    sums = jnp.einsum("...gk,gkn->...gn", x_groups, q.reshape(groups, k // groups, n).astype(jnp.float32),
                      preferred_element_type=jnp.float32)
    y = (sums * scales.astype(jnp.float32)).sum(axis=-2)
    return y if mins is None else y + x_groups.sum(axis=-1) @ mins.astype(jnp.float32)
