"""Ragged attention over the paged KV pool: prefill chunks and decodes in one batch.

The step's new tokens are one flat ragged array (see reference.py): request r
owns q[query_start_loc[r]:query_start_loc[r + 1]], its newest q_len tokens,
which attend causally to the request's cached tokens and to the new tokens
before them.

Work list. Each request's new tokens are cut into query tiles of `block_q`
tokens; XLA lists the (request, tile) pairs of the step, at most
T // block_q + min(R, T) of them (each request adds at most one partial tile),
so the grid is static and has no empty request x tile products. Grid
(tiles, kv_heads): one program takes block_q tokens x the query heads of one
KV head, i.e. block_q * group rows of one dot, and walks the request's pages
up to its last token's position with an online softmax, causal mask on the
way.

Tiles are not aligned to block_q in the flat batch, so the flat q and the
output stay in global memory (`memory_space=pl.ANY`) and a program reads its
rows by dynamic slice and writes them with a masked store: rows past the
request's q_len belong to the next request and are never written. q and the
output are padded by block_q rows so a slice never leaves the array (Triton's
masked accesses would not need that; interpret mode's slices would clamp). The
output starts as zeros (aliased), so padding tokens give 0 as the contract says.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from kernels_pallas.paged_attention import (
    MIN_DOT,
    check_kernel_shapes,
    check_pool,
    check_window,
    init_softmax_carry,
    load_kv_tile,
    online_softmax_step,
    pick_pages_per_tile,
)
from kernels_pallas.reference import AttentionMetadata, query_tiles, ragged_paged_attention_reference

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "query_tiles"]

TARGET_ROWS = 64  # block_q * group: rows of the score tile, enough to reuse each K/V tile well.


def _ragged_kernel(
    tile_req_ref,  # [W] int32 (pl.ANY)
    tile_idx_ref,  # [W] int32 (pl.ANY)
    query_start_loc_ref,  # [R + 1] int32 (pl.ANY)
    seq_lens_ref,  # [R] int32 (pl.ANY)
    block_tables_ref,  # [R, P] int32 (pl.ANY)
    q_ref,  # [T + block_q, Hkv, G, D] (pl.ANY)
    k_pages_ref,  # [Hkv, N, S, D] (pl.ANY)
    v_pages_ref,  # [Hkv, N, S, D] (pl.ANY)
    zeros_ref,  # aliased with o_ref
    o_ref,  # [T + block_q, Hkv, G, D] (pl.ANY)
    *,
    sm_scale: float,
    block_q: int,
    pages_per_tile: int,
    sliding_window: int | None,
):
    del zeros_ref  # Only there to give o_ref its zeros.
    work, kv_head = pl.program_id(0), pl.program_id(1)
    _, _, group, head_dim = q_ref.shape
    _, _, block_size, _ = k_pages_ref.shape
    block_kv = pages_per_tile * block_size
    rows = block_q * group

    req, tile = tile_req_ref[work], tile_idx_ref[work]
    q_start = query_start_loc_ref[req]
    q_len = query_start_loc_ref[req + 1] - q_start
    seq_len = seq_lens_ref[req]
    num_rows = jnp.clip(q_len - tile * block_q, 0, block_q)  # real tokens in this tile
    first_pos = seq_len - q_len + tile * block_q  # absolute position of the tile's first token
    tile_start = q_start + tile * block_q

    row_pos = first_pos + jnp.arange(rows, dtype=jnp.int32) // group  # position of each score row's token
    # Keys from the first the tile's first row may see (its window's start) up to its last real token.
    first_page = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0) // block_size
    num_kv_tiles = jnp.where(num_rows > 0, pl.cdiv(first_pos + num_rows - first_page * block_size, block_kv), 0)
    q = q_ref[pl.ds(tile_start, block_q), kv_head].reshape(rows, head_dim)

    def one_tile(t, carry):
        k, v, kv_pos = load_kv_tile(
            k_pages_ref, v_pages_ref, block_tables_ref, req, kv_head, first_page + t * pages_per_tile, seq_len,
            pages_per_tile,
        )
        visible = (kv_pos[None, :] < seq_len) & (kv_pos[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            visible &= kv_pos[None, :] > row_pos[:, None] - sliding_window
        return online_softmax_step(carry, q, k, v, visible, sm_scale)

    _, l, acc = jax.lax.fori_loop(0, num_kv_tiles, one_tile, init_softmax_carry(rows, head_dim))
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype).reshape(block_q, group, head_dim)
    is_mine = jnp.arange(block_q, dtype=jnp.int32) < num_rows
    pltriton.store(
        o_ref.at[pl.ds(tile_start, block_q), kv_head],
        out,
        mask=jnp.broadcast_to(is_mine[:, None, None], out.shape),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "block_q", "pages_per_tile", "num_warps", "num_stages", "interpret", "sliding_window", "k_scale",
        "v_scale",
    ),
)
def ragged_paged_attention(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    *,
    block_q: int | None = None,
    pages_per_tile: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "tokens q_heads dim"]:
    """Causal attention of a ragged batch over the paged pool; equals `ragged_paged_attention_reference`.

    block_q: new tokens per program (default: TARGET_ROWS score rows).
    pages_per_tile: pages per online-softmax step (default: 64 tokens' worth, at least 16).
    sliding_window: each token sees only its last `sliding_window` keys; a query tile's walk starts
    at the page holding its first row's first key, so it is bounded by block_q + the window.
    k_scale, v_scale: the pool's (reference.py), applied as in `paged_decode_attention`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    num_reqs, max_blocks = metadata.block_tables.shape
    check_kernel_shapes(num_q_heads, num_kv_heads, head_dim, block_size)
    check_pool(head_dim, k_pages, v_pages)
    if metadata.query_start_loc.shape != (num_reqs + 1,) or metadata.seq_lens.shape != (num_reqs,):
        raise ValueError(
            f"block_tables has {num_reqs} rows, so query_start_loc must be ({num_reqs + 1},) and seq_lens "
            f"({num_reqs},); got {metadata.query_start_loc.shape} and {metadata.seq_lens.shape}"
        )
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    if block_q is None:
        block_q = max(1, TARGET_ROWS // group_pad)
    if block_q < 1 or block_q & (block_q - 1) or block_q * group_pad < MIN_DOT:
        raise ValueError(
            f"block_q={block_q} with {group_pad} query heads per KV head gives {block_q * group_pad} score rows; "
            f"use a power of two giving at least {MIN_DOT} rows"
        )
    pages_per_tile = pick_pages_per_tile(pages_per_tile, block_size, default_tokens=64)
    check_window(sliding_window)
    # Null-block padding so the last kv tile's block-table read stays inside the row (a window's
    # walk starts at any page, not on a tile boundary).
    pad = -max_blocks % pages_per_tile if sliding_window is None else pages_per_tile
    block_tables = jnp.pad(metadata.block_tables, ((0, 0), (0, pad)))
    tile_req, tile_idx = query_tiles(metadata.query_start_loc, num_tokens, block_q)

    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    zeros = jnp.zeros_like(q_grouped)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _ragged_kernel, sm_scale=sm_scale * k_scale, block_q=block_q, pages_per_tile=pages_per_tile, sliding_window=sliding_window
    )
    out = pl.pallas_call(
        kernel,
        grid=(tile_req.shape[0], num_kv_heads),
        in_specs=[any_spec] * 9,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct(q_grouped.shape, q.dtype),
        input_output_aliases={8: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{block_q=}_{pages_per_tile=}",
    )(
        tile_req,
        tile_idx,
        metadata.query_start_loc.astype(jnp.int32),
        metadata.seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q_grouped,
        k_pages,
        v_pages,
        zeros,
    )
    out = out[:num_tokens, :, :group].reshape(num_tokens, num_q_heads, head_dim)
    return (out.astype(jnp.float32) * v_scale).astype(q.dtype) if v_scale != 1.0 else out
