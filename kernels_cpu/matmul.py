"""x @ w with w packed in 32-column panels: the C++ kernel (`packed_matmul.cc`) and its jnp reference.

A float32 [K, N] weight packed is [N / 32, K, 32]: panel p holds columns 32p..32p+31, row by
row, so the kernel streams each panel from memory in one run. A bfloat16 one is [N / 32,
ceil(K / 2), 64]: the same panels with rows k and k+1 interleaved per column (a zero row pads an
odd K), the pairs the bf16 dot instruction multiplies; x is then rounded to bfloat16 and the
products summed in float32, as XLA's bf16 x bf16 -> f32 dot of x.astype(bf16) does. Only widths
that are a multiple of 32 pack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kernels_cpu.registry import target

PANEL = 32  # columns per panel
LAYOUT = "packed-1"  # the packed layout's name in the weights cache: a new one for any change to pack_weight
TARGETS = {jnp.dtype(jnp.float32): "CbjaxPackedMatmulF32", jnp.dtype(jnp.bfloat16): "CbjaxPackedMatmulBF16"}


def packable(shape: tuple[int, ...], dtype: np.dtype | jnp.dtype) -> bool:
    """Whether a [K, N] weight of this shape and dtype can be packed for the kernel (float32 or
    bfloat16, N a multiple of 32)."""
    return len(shape) == 2 and shape[1] % PANEL == 0 and shape[1] > 0 and jnp.dtype(dtype) in TARGETS


def pack_weight(w: Float[np.ndarray, "k n"]) -> Float[np.ndarray, "panels steps width"]:
    """[K, N] -> [N / 32, K, 32] (float32) or [N / 32, ceil(K / 2), 64] (bfloat16), contiguous (a host copy)."""
    if not packable(w.shape, w.dtype):
        raise ValueError(
            f"pack_weight takes a float32 or bfloat16 [K, N] weight with N a multiple of {PANEL}, got {w.dtype} {w.shape}"
        )
    w = np.asarray(w)
    k, n = w.shape
    if w.dtype == np.float32:
        return np.ascontiguousarray(w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2))
    pairs = np.concatenate([w, np.zeros((k % 2, n), w.dtype)]).reshape(-1, 2, n // PANEL, PANEL)
    return np.ascontiguousarray(pairs.transpose(2, 0, 3, 1)).reshape(n // PANEL, -1, 2 * PANEL)


def unpack_weight(packed: Float[Array, "panels steps width"], k: int | None = None) -> Float[Array, "k n"]:
    """pack_weight's inverse; `k` trims the zero row that pads a bfloat16 weight of odd K."""
    panels, steps, width = packed.shape
    per_step = width // PANEL
    w = packed.reshape(panels, steps, PANEL, per_step).transpose(1, 3, 0, 2).reshape(steps * per_step, panels * PANEL)
    return w[: k if k is not None else steps * per_step]


def packed_matmul_reference(x: Float[Array, "*rows k"], packed: Float[Array, "panels steps width"]) -> Float[Array, "*rows n"]:
    """x @ w from the packed w, in jnp (any platform): what the kernel computes."""
    w = unpack_weight(packed, x.shape[-1])
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def packed_matmul_cpu(x: Float[Array, "*rows k"], packed: Float[Array, "panels steps width"]) -> Float[Array, "*rows n"]:
    """x @ w from the packed w, by the C++ kernel (CPU only); float32 x and result."""
    if (
        packed.ndim != 3 or jnp.dtype(packed.dtype) not in TARGETS
        or packed.shape[2] != PANEL * (2 if packed.dtype == jnp.bfloat16 else 1)
        or -(-x.shape[-1] // (packed.shape[2] // PANEL)) != packed.shape[1]
    ):
        raise ValueError(
            f"packed_matmul_cpu: x {x.shape} does not match a packed weight {packed.dtype} {packed.shape} "
            f"(float32 [N / {PANEL}, K, {PANEL}] or bfloat16 [N / {PANEL}, ceil(K / 2), {2 * PANEL}])"
        )
    out = jax.ShapeDtypeStruct((*x.shape[:-1], packed.shape[0] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(target(TARGETS[jnp.dtype(packed.dtype)]), out)(x.astype(jnp.float32), packed)


