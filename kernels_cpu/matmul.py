"""x @ w with w packed in 32-column panels: the C++ kernel (`packed_matmul.cc`) and its jnp reference.

A [K, N] weight packed is [N / 32, K, 32]: panel p holds columns 32p..32p+31, row by row, so
the kernel streams each panel from memory in one run. Only widths that are a multiple of 32 pack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kernels_cpu.registry import target

PANEL = 32  # columns per panel


def packable(shape: tuple[int, ...], dtype: np.dtype | jnp.dtype) -> bool:
    """Whether a [K, N] weight of this shape and dtype can be packed for the kernel (float32, N a multiple of 32)."""
    return len(shape) == 2 and shape[1] % PANEL == 0 and shape[1] > 0 and jnp.dtype(dtype) == jnp.float32


def pack_weight(w: Float[np.ndarray, "k n"]) -> Float[np.ndarray, "panels k 32"]:
    """[K, N] -> [N / 32, K, 32], contiguous (a host copy)."""
    if not packable(w.shape, w.dtype):
        raise ValueError(f"pack_weight takes a float32 [K, N] weight with N a multiple of {PANEL}, got {w.dtype} {w.shape}")
    return np.ascontiguousarray(np.asarray(w).reshape(w.shape[0], -1, PANEL).transpose(1, 0, 2))


def unpack_weight(packed: Float[Array, "panels k 32"]) -> Float[Array, "k n"]:
    """pack_weight's inverse."""
    return jnp.transpose(packed, (1, 0, 2)).reshape(packed.shape[1], -1)


def packed_matmul_reference(x: Float[Array, "*rows k"], packed: Float[Array, "panels k 32"]) -> Float[Array, "*rows n"]:
    """x @ w from the packed w, in jnp (any platform): what the kernel computes."""
    y = jnp.einsum("...k,pkc->...pc", x.astype(jnp.float32), packed, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:-1], packed.shape[0] * PANEL)


def packed_matmul_cpu(x: Float[Array, "*rows k"], packed: Float[Array, "panels k 32"]) -> Float[Array, "*rows n"]:
    """x @ w from the packed w, by the C++ kernel (CPU only; float32)."""
    if packed.ndim != 3 or packed.shape[2] != PANEL or x.shape[-1] != packed.shape[1]:
        raise ValueError(f"packed_matmul_cpu: x {x.shape} does not match a packed [N / {PANEL}, K, {PANEL}] weight {packed.shape}")
    out = jax.ShapeDtypeStruct((*x.shape[:-1], packed.shape[0] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(target("CbjaxPackedMatmulF32"), out)(x.astype(jnp.float32), packed.astype(jnp.float32))
