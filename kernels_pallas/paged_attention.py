"""Decode attention over the paged KV pool: one query token per request.

Grid (requests, kv_heads, splits). One program takes the query heads of one KV
head of one request ([group, dim], the group padded to a power of two >= 16 so
Triton can take the dot) and walks its part of the request's pages with an
online softmax, `pages_per_tile` pages at a time. The pool stays in global
memory (`memory_space=pl.ANY`); the program reads the request's block-table row
and gathers its pages itself, so no request needs contiguous KV memory.

Split-K: the request's pages are cut into `num_splits` partitions, each a
program of its own; each writes its normalised partial output and its
log-sum-exp, and XLA combines them. A few long sequences then still give the
GPU enough programs to fill it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from kernels_pallas.reference import is_fp8, paged_decode_attention_reference

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "check_kernel_shapes"]

MIN_DOT = 16  # Triton takes dots whose operands are at least 16 in every dimension.
TARGET_PROGRAMS = 512  # ~4 programs per SM on an H100/H200 (132 SMs): enough to hide latency.


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def padded_group(group: int) -> int:
    """Query heads per KV head, padded to the power of two >= 16 the Triton dot needs."""
    return max(MIN_DOT, pl.next_power_of_2(group))


def check_kernel_shapes(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Raise ValueError saying which shape the Pallas kernels cannot take, and what to do."""
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs every KV head to serve the same number of query heads"
        )
    if not _is_pow2(head_dim) or head_dim < MIN_DOT:
        raise ValueError(
            f"head_dim={head_dim} must be a power of two >= {MIN_DOT} for the Triton kernels "
            "(block dims are powers of two, dots at least 16); use attention backend 'xla' for this model"
        )
    if not _is_pow2(block_size):
        raise ValueError(
            f"block_size={block_size} must be a power of two for the Triton kernels; "
            "pick a KV block size of 8, 16, 32, ..."
        )


def check_pool(q_head_dim: int, k_pages: Array, v_pages: Array) -> None:
    """The K and V pools agree with each other and with q."""
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.shape} {k_pages.dtype} and v_pages {v_pages.shape} {v_pages.dtype} differ")
    if k_pages.shape[3] != q_head_dim:
        raise ValueError(f"q has head_dim {q_head_dim} but the pool has {k_pages.shape[3]}; they must match")


def check_window(sliding_window: int | None) -> None:
    """A sliding window is a positive number of keys (None: full attention)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}; give a positive number of keys, or None for full attention")


def pick_pages_per_tile(pages_per_tile: int | None, block_size: int, default_tokens: int) -> int:
    """Pages per online-softmax step: `default_tokens` worth unless given; a power of two, >= 16 tokens."""
    if pages_per_tile is None:
        pages_per_tile = max(pl.cdiv(MIN_DOT, block_size), default_tokens // block_size, 1)
    if not _is_pow2(pages_per_tile) or pages_per_tile * block_size < MIN_DOT:
        raise ValueError(
            f"pages_per_tile={pages_per_tile} with block_size={block_size} gives tiles of "
            f"{pages_per_tile * block_size} tokens; use a power of two with at least {MIN_DOT} tokens per tile"
        )
    return pages_per_tile


def load_kv_tile(k_pages_ref, v_pages_ref, block_tables_ref, req, kv_head, page0, seq_len, pages_per_tile: int):
    """K and V [tile, D] from pages page0... of request `req`, zero past seq_len, and their positions.

    Pages past the sequence read the null block, whatever the table holds there; what lies past
    seq_len is zeroed because 0 * NaN garbage would still be NaN in the dots.
    """
    _, _, block_size, head_dim = k_pages_ref.shape
    tile_len = pages_per_tile * block_size
    page_idx = page0 + jnp.arange(pages_per_tile, dtype=jnp.int32)
    in_seq_pages = page_idx < pl.cdiv(seq_len, block_size)
    pages = jnp.where(in_seq_pages, block_tables_ref[req, pl.ds(page0, pages_per_tile)], 0)
    k = k_pages_ref[kv_head, pages].reshape(tile_len, head_dim)
    v = v_pages_ref[kv_head, pages].reshape(tile_len, head_dim)
    kv_pos = page0 * block_size + jnp.arange(tile_len, dtype=jnp.int32)
    in_seq = kv_pos < seq_len
    k = jnp.where(in_seq[:, None], k, jnp.zeros_like(k))
    v = jnp.where(in_seq[:, None], v, jnp.zeros_like(v))
    return k, v, kv_pos


def init_softmax_carry(rows: int, head_dim: int):
    """Running max (-inf), sum and unnormalised output of an online softmax, all f32."""
    return (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def online_softmax_step(carry, q, k, v, visible, sm_scale: float):
    """Fold one K/V tile [tile, D] into the running softmax of q's rows; `visible` [rows, tile] masks scores.

    A row may see no key of a tile (a sliding window that starts past it): its running max stays
    -inf and the exponentials are taken against 0 instead, so it keeps l = 0 and acc = 0.
    """
    m, l, acc = carry
    if is_fp8(k.dtype):  # every e4m3 value is exact in bf16, f16 and f32 (its scales are the wrapper's)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    # A pool dtype other than the activations' (an f16 pool under bf16 or f32 activations) meets q
    # here; Triton's dot takes one element type, so both go to the type that holds either exactly.
    common = jnp.promote_types(q.dtype, k.dtype)
    s = jax.lax.dot_general(q.astype(common), k.astype(common), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(visible, s * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + pv


def _decode_kernel(
    seq_lens_ref,  # [R] int32, whole array (pl.ANY)
    block_tables_ref,  # [R, P] int32, whole array (pl.ANY)
    q_ref,  # [G, D] this request's query heads of this KV head
    k_pages_ref,  # [Hkv, N, S, D] the whole pool (pl.ANY)
    v_pages_ref,  # [Hkv, N, S, D]
    o_ref,  # [G, D] normalised partial output of this split
    lse_ref,  # [G] log-sum-exp of this split's scores; -inf if it saw no key
    *,
    sm_scale: float,
    pages_per_tile: int,
    pages_per_split: int,
    sliding_window: int | None,
):
    req, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, _, block_size, head_dim = k_pages_ref.shape
    seq_len = seq_lens_ref[req]
    # The query sits at seq_len - 1; with a window it sees keys from seq_len - window on, so the
    # splits partition the pages from the one holding that key, never those before it.
    first_key = 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)
    first_page = first_key // block_size + split * pages_per_split
    num_tiles = pl.cdiv(jnp.clip(pl.cdiv(seq_len, block_size) - first_page, 0, pages_per_split), pages_per_tile)
    q = q_ref[...]

    def one_tile(t, carry):
        page0 = first_page + t * pages_per_tile
        k, v, kv_pos = load_kv_tile(
            k_pages_ref, v_pages_ref, block_tables_ref, req, kv_head, page0, seq_len, pages_per_tile
        )
        visible = (kv_pos < seq_len) & (kv_pos >= first_key)
        return online_softmax_step(carry, q, k, v, visible[None, :], sm_scale)

    m, l, acc = jax.lax.fori_loop(0, num_tiles, one_tile, init_softmax_carry(q.shape[0], head_dim))
    saw_keys = l > 0
    o_ref[...] = (acc / jnp.where(saw_keys, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(saw_keys, m + jnp.log(jnp.where(saw_keys, l, 1.0)), -jnp.inf)


def default_num_splits(num_reqs: int, num_kv_heads: int, max_tiles: int) -> int:
    """Enough KV partitions that requests x kv_heads x splits reaches TARGET_PROGRAMS, at most one per tile."""
    return max(1, min(pl.cdiv(TARGET_PROGRAMS, num_reqs * num_kv_heads), max_tiles))


def combine_splits(
    o: Float[Array, "splits reqs kv_heads group dim"],
    lse: Float[Array, "splits reqs kv_heads group"],
) -> Float[Array, "reqs kv_heads group dim"]:
    """Merge per-split softmax results by their log-sum-exp; a row no split saw a key for gives 0."""
    lse_max = lse.max(axis=0)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    weight = jnp.exp(lse - lse_max[None])  # 0 for splits that saw no key
    total = weight.sum(axis=0)
    out = (weight[..., None] * o.astype(jnp.float32)).sum(axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "pages_per_tile", "num_splits", "num_warps", "num_stages", "interpret", "sliding_window",
        "k_scale", "v_scale",
    ),
)
def paged_decode_attention(
    q: Float[Array, "reqs q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    seq_lens: Int[Array, "reqs"],
    block_tables: Int[Array, "reqs max_blocks"],
    sm_scale: float,
    *,
    pages_per_tile: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "reqs q_heads dim"]:
    """Decode attention; equals `paged_decode_attention_reference`.

    pages_per_tile: pages per online-softmax step (default: 128 tokens' worth, at least 16 tokens).
    num_splits: KV partitions per request, combined in XLA (default: enough to fill the GPU).
    sliding_window: each query sees only its last `sliding_window` keys; the splits then cover the
    pages that window can touch, so the work per request stops growing with its length.
    k_scale, v_scale: the pool's (reference.py); the kernel reads unscaled elements, so k_scale joins sm_scale
    and v_scale multiplies the output.
    """
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_kernel_shapes(num_q_heads, num_kv_heads, head_dim, block_size)
    check_pool(head_dim, k_pages, v_pages)
    if seq_lens.shape != (num_reqs,) or block_tables.shape[0] != num_reqs:
        raise ValueError(
            f"q has {num_reqs} requests but seq_lens is {seq_lens.shape} and block_tables {block_tables.shape}; "
            "give one seq_len and one block-table row per query token"
        )
    max_blocks = block_tables.shape[1]
    pages_per_tile = pick_pages_per_tile(pages_per_tile, block_size, default_tokens=128)
    check_window(sliding_window)
    # Pages one query reads: all of the row's, or those its window touches (it may start mid-page).
    visited_pages = max_blocks if sliding_window is None else min(max_blocks, (sliding_window - 1) // block_size + 2)
    max_tiles = pl.cdiv(visited_pages, pages_per_tile)
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, num_kv_heads, max_tiles)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}; use 1 (no split-K) or more")
    pages_per_split = pl.cdiv(max_tiles, num_splits) * pages_per_tile
    # Pad with the null block so every tile's block-table read stays inside the row (a window's
    # walk starts at any page of the row).
    first_page_max = 0 if sliding_window is None else max_blocks - 1
    block_tables = jnp.pad(block_tables, ((0, 0), (0, first_page_max + num_splits * pages_per_split - max_blocks)))

    group = num_q_heads // num_kv_heads
    group_pad = padded_group(group)
    q_grouped = q.reshape(num_reqs, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    partial_dtype = q.dtype if num_splits == 1 else jnp.float32

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale * k_scale, pages_per_tile=pages_per_tile, pages_per_split=pages_per_split,
        sliding_window=sliding_window,
    )
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_reqs, num_kv_heads, num_splits),
        in_specs=[
            any_spec,
            any_spec,
            pl.BlockSpec((None, None, group_pad, head_dim), lambda r, h, s: (r, h, 0, 0)),
            any_spec,
            any_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group_pad, head_dim), lambda r, h, s: (s, r, h, 0, 0)),
            pl.BlockSpec((None, None, None, group_pad), lambda r, h, s: (s, r, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, num_reqs, num_kv_heads, group_pad, head_dim), partial_dtype),
            jax.ShapeDtypeStruct((num_splits, num_reqs, num_kv_heads, group_pad), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_attention_{pages_per_tile=}_{num_splits=}",
    )(seq_lens.astype(jnp.int32), block_tables.astype(jnp.int32), q_grouped, k_pages, v_pages)

    out = o[0] if num_splits == 1 else combine_splits(o, lse)
    out = out[:, :, :group].reshape(num_reqs, num_q_heads, head_dim)
    return (out.astype(jnp.float32) * v_scale if v_scale != 1.0 else out).astype(q.dtype)

