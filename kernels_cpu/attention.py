"""The C++ paged attention as a jax function: registration with XLA and the call."""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kernels_cpu.build import build
from kernels_pallas.reference import AttentionMetadata

# FFI target per pool dtype; the queries and the output are float32 (CPU activations).
TARGETS = {
    jnp.dtype(jnp.float32): ("cbjax_paged_attention_f32", "CbjaxPagedAttentionF32"),
    jnp.dtype(jnp.float16): ("cbjax_paged_attention_f16", "CbjaxPagedAttentionF16"),
    jnp.dtype(jnp.bfloat16): ("cbjax_paged_attention_bf16", "CbjaxPagedAttentionBF16"),
}


@functools.lru_cache(maxsize=None)
def _register() -> None:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")


def kernel_problem() -> str | None:
    """Why the kernel can't run here (no compiler, a failed build), or None once it is registered."""
    try:
        _register()
    except Exception as error:  # noqa: BLE001 - any failure means "serve with the jnp path", with the reason
        return f"{type(error).__name__}: {error}"
    return None


def ragged_paged_attention_cpu(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
) -> Float[Array, "tokens q_heads dim"]:
    """`ragged_paged_attention_reference`'s result, computed by the C++ kernel (CPU only).

    Decode steps are the case of one token per request; there is no separate decode entry.
    """
    if k_pages.dtype not in TARGETS or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"the CPU attention kernel takes float32, float16 or bfloat16 pools, got K {k_pages.dtype} and "
            f"V {v_pages.dtype}; use kv_cache_dtype='float32' or 'float16', or attention_backend='xla'"
        )
    _register()
    call = jax.ffi.ffi_call(TARGETS[k_pages.dtype][0], jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        metadata.query_start_loc.astype(jnp.int32),
        metadata.seq_lens.astype(jnp.int32),
        metadata.block_tables.astype(jnp.int32),
        sm_scale=np.float32(sm_scale),
    )
    return out.astype(q.dtype)
