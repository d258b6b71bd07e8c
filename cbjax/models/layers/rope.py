"""Rotary position embeddings, in Hugging Face's rotate-half layout (not GGUF's interleaved one)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from cbjax.models.config import RopeScaling


@functools.lru_cache(maxsize=None)
def rope_inv_freq(dim: int, rope_theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies [dim // 2] (float32), scaled like transformers' ROPE_INIT_FUNCTIONS; a layer's
    base and scaling are ModelConfig.rope(layer)'s (layers may differ: Gemma 3's local and global)."""
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                                    scaling.original_max_position_embeddings)
    return inv_freq.astype(np.float32)


def _llama3_inv_freq(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                     old_context_len: int) -> np.ndarray:
    """Llama 3.1: slow down long wavelengths by `factor`, keep short ones, blend smoothly in between."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: Int[Array, "tokens"], inv_freq: np.ndarray
) -> tuple[Float[Array, "tokens 1 dim"], Float[Array, "tokens 1 dim"]]:
    """Each token's rotation, cos and sin of its angles (float32), for every head of q and k alike.

    Each half is copied to both halves of the head by a product with [I I]: exact, and a dot is one op XLA:CPU
    does not fuse into the rotation, so cos and sin are computed once per token and frequency. As elementwise
    ops they were fused into q's and k's rotations and evaluated again for every head
    (`python -m benchmarks.profile_long_steps`, the fusions).
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    half = angles.shape[-1]
    both_halves = jnp.asarray(np.concatenate([np.eye(half, dtype=np.float32)] * 2, axis=1))  # [D/2, D]
    cos, sin = (jnp.dot(f(angles), both_halves, precision=jax.lax.Precision.HIGHEST) for f in (jnp.cos, jnp.sin))
    return cos[:, None, :], sin[:, None, :]


def rotate(
    x: Float[Array, "tokens heads dim"], cos: Float[Array, "tokens 1 dim"], sin: Float[Array, "tokens 1 dim"]
) -> Float[Array, "tokens heads dim"]:
    """x rotated by rope_cos_sin's angles; the product in x's dtype (as HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)
