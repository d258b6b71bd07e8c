"""Rotary position embeddings, in Hugging Face's rotate-half layout (not GGUF's interleaved one)."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from cbjax.models.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig, layer: int) -> np.ndarray:
    """Layer `layer`'s inverse frequencies [head_dim // 2] (float32); layers may differ (Gemma 3's local and global)."""
    return _inv_freq(config.head_dim, *config.rope(layer))


@functools.lru_cache(maxsize=None)
def _inv_freq(dim: int, rope_theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies [dim // 2] (float32), scaled like transformers' ROPE_INIT_FUNCTIONS."""
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


def apply_rope(
    x: Float[Array, "tokens heads dim"],
    positions: Int[Array, "tokens"],
    inv_freq: np.ndarray,
) -> Float[Array, "tokens heads dim"]:
    """Rotate each token's heads by its position; angles in float32, the product in x's dtype (as HF)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
