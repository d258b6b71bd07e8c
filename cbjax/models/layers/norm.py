"""RMSNorm as Hugging Face's Llama-family and Gemma models compute it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalize in float32, cast back, then scale (so bf16 rounds where HF does)."""

    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... size"]) -> Float[Array, "... size"]:
        return self.weight[...] * self.normalized(x).astype(x.dtype)

    def normalized(self, x: Float[Array, "... size"]) -> Float[Array, "... size"]:
        """x over its root mean square, in float32 (before the scale)."""
        x32 = x.astype(jnp.float32)
        return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)


class GemmaRMSNorm(RMSNorm):
    """HF's Gemma RMSNorm: the scale is 1 + weight (weights start at 0), applied in float32 before casting back."""

    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype):
        super().__init__(size, eps, dtype=dtype)
        self.weight = nnx.Param(jnp.zeros((size,), dtype))

    def __call__(self, x: Float[Array, "... size"]) -> Float[Array, "... size"]:
        return ((1.0 + self.weight[...].astype(jnp.float32)) * self.normalized(x)).astype(x.dtype)
