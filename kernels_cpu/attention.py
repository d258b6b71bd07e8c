"""The C++ paged attention as jax functions (the library's registration is registry.py's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kernels_cpu.registry import POOL_SUFFIXES, target
from kernels_pallas.reference import AttentionMetadata

# A pool's scales go to the kernel as attributes, which applies them: the write divides by them, k_scale joins
# sm_scale (q * k_scale . k = q . (k * k_scale)) and v_scale the output (P . (v * v_scale) = (P . v) * v_scale).


def _target_suffix(k_pages: Array, v_pages: Array) -> str:
    """The attention targets' suffix for these pools' dtype, once the pools are checked."""
    if k_pages.dtype not in POOL_SUFFIXES or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"the CPU attention kernel takes float32, float16, bfloat16 or float8_e4m3fn pools, got K {k_pages.dtype} "
            f"and V {v_pages.dtype}; use kv_cache_dtype='float32', 'float16' or 'fp8', or attention_backend='xla'"
        )
    return POOL_SUFFIXES[k_pages.dtype]


def _request_metadata(metadata: AttentionMetadata) -> tuple[Array, Array, Array]:
    """The kernel's last three inputs: query_start_loc, seq_lens, block_tables (int32)."""
    return tuple(x.astype(jnp.int32) for x in (metadata.query_start_loc, metadata.seq_lens, metadata.block_tables))


def scale_attributes(sm_scale: float, k_scale: float, v_scale: float) -> dict[str, np.float32]:
    """The kernel's float attributes: the softmax scale and the pools' scales (1.0 for float pools)."""
    return {"sm_scale": np.float32(sm_scale), "k_scale": np.float32(k_scale), "v_scale": np.float32(v_scale)}


def _window_attribute(sliding_window: int | None) -> np.int32:
    """The kernel's `sliding_window` attribute: the window in tokens, 0 for none."""
    if sliding_window is None:
        return np.int32(0)
    if not 1 <= sliding_window <= np.iinfo(np.int32).max:
        raise ValueError(f"sliding_window={sliding_window}: a window covers at least the query's own token (>= 1) "
                         "and fits int32; pass None for full attention")
    return np.int32(sliding_window)


def write_kv_and_attend_cpu(
    q: Float[Array, "tokens q_heads dim"],
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[Float[Array, "tokens q_heads dim"], Float[Array, "kv_heads blocks block_size dim"], Float[Array, "kv_heads blocks block_size dim"]]:
    """`write_kv` then `ragged_paged_attention_reference`, in one C++ call (CPU only).

    The pools go in and come out aliased, so under a donating jit the write is in place. Decode
    steps are the case of one token per request; there is no separate decode entry.
    `sliding_window` and the pools' scales are the reference's (a query at position p sees keys p - W + 1..p).
    """
    suffix = _target_suffix(k_pages, v_pages)
    call = jax.ffi.ffi_call(
        target("CbjaxWriteKvAttention" + suffix),
        (jax.ShapeDtypeStruct(q.shape, jnp.float32), k_pages, v_pages),
        input_output_aliases={4: 1, 5: 2},
    )
    out, k_pages, v_pages = call(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        metadata.slot_mapping.astype(jnp.int32),
        k_pages,
        v_pages,
        *_request_metadata(metadata),
        **scale_attributes(sm_scale, k_scale, v_scale),
        sliding_window=_window_attribute(sliding_window),
    )
    return out.astype(q.dtype), k_pages, v_pages


def ragged_paged_attention_cpu(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "tokens q_heads dim"]:
    """`ragged_paged_attention_reference`'s result (`sliding_window` and the pools' scales included) from the C++
    kernel; the pools are only read."""
    suffix = _target_suffix(k_pages, v_pages)
    call = jax.ffi.ffi_call(target("CbjaxPagedAttention" + suffix), jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32), k_pages, v_pages, *_request_metadata(metadata),
        **scale_attributes(sm_scale, k_scale, v_scale), sliding_window=_window_attribute(sliding_window),
    )
    return out.astype(q.dtype)
