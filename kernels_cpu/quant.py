"""Weight-only int8 quantization (issue 38): symmetric, per output channel, float32 scales.

A float [K, N] weight becomes int8 q [K, N] and scales [N] with w ~= q * scales: each column's
scale is its largest |w| / 127, so every element is off by at most half its column's scale. The
product x @ w is (x @ q) * scales: the scale multiplies the N outputs, not the K*N weights, so
no float copy of the weight is made (XLA fuses the int8 -> float convert into the dot). This is
the jnp path every platform runs (and the one `cuda` lowers); vLLM's and torchao's int8
weight-only scheme is the same.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8

INT8_MAX = 127


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


def int8_matmul(
    x: Float[Array, "*rows k"], q: Int8[Array, "k n"], scales: Float[Array, " n"]
) -> Float[Array, "*rows n"]:
    """x @ (q * scales) as (x @ q) * scales, accumulated in float32 (any platform)."""
    if q.ndim != 2 or q.dtype != jnp.int8 or scales.shape != (q.shape[1],) or x.shape[-1] != q.shape[0]:
        raise ValueError(
            f"int8_matmul: x {x.shape} does not match an int8 weight {q.dtype} {q.shape} with scales {scales.shape} "
            f"(int8 [K, N], float32 [N], x [..., K])"
        )
    y = jnp.dot(x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return y * scales.astype(jnp.float32)
