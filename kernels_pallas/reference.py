"""Plain-jnp references of every attention kernel, and the contract they share.

KV pool layout (what a kernel sees):

    k_pages, v_pages: [num_kv_heads, num_blocks, block_size, head_dim]

Block 0 is the null block: padded block-table entries point at it and padded
tokens write into it, so its contents are garbage and are never read unmasked.
A token's *slot* is `block_id * block_size + offset_in_block`. A model keeps
every layer's pages in one such pair, layer l's blocks after those of the layers
before it; `AttentionMetadata.in_layer` moves a step's block ids and slots to a
layer's blocks, so the kernels never know which layer they serve (layer l's
null block is its first, and padding still only touches null blocks).

One step's tokens form a flat ragged batch of T tokens (T is a bucket size).
Requests occupy rows 0..R-1 of the metadata (R is a bucket size too); the
tokens of request r are q[query_start_loc[r]:query_start_loc[r + 1]]. These are
the request's *newest* q_len tokens: they sit at absolute positions
seq_lens[r] - q_len ... seq_lens[r] - 1, and each attends causally to every
KV position up to and including its own (the cached prefix plus the new tokens
before it). Padded request rows have q_len 0 and seq_len 0; tokens at index
>= query_start_loc[R] are padding and their output is 0.

The new K/V of a step are written into the pool (`write_kv`) before attention
reads it, so the kernels only ever read the pool.

fp8 pools (float8_e4m3fn, vLLM's kv_cache_dtype="fp8"): a page element e stands
for e * k_scale (K) or e * v_scale (V), one float per pool (vLLM's per-layer
k_scale/v_scale; 1.0 unless given). Writes divide by the scale and saturate at
+-448 (e4m3fn has no infinity, so an overflow would become NaN); every read
widens to float and multiplies by the scale. Float pools take scale 1.0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token goes and what each request attends to (all int32)."""

    slot_mapping: Int[Array, "tokens"]  # pool slot of each new token; padding -> a null-block slot
    query_start_loc: Int[Array, "reqs_plus_1"]  # cumulative q lengths; padded rows repeat the total
    seq_lens: Int[Array, "reqs"]  # KV length after this step (cached + new); 0 for padded rows
    block_tables: Int[Array, "reqs max_blocks"]  # block ids per request; padded with 0 (null block)

    def in_layer(self, first_block: int, block_size: int) -> AttentionMetadata:
        """The same step in a pool whose blocks start at `first_block` (one layer's of all layers' pool)."""
        if first_block == 0:
            return self
        return dataclasses.replace(
            self, slot_mapping=self.slot_mapping + first_block * block_size, block_tables=self.block_tables + first_block
        )


def is_fp8(dtype) -> bool:
    """An 8-bit float pool: its elements are scaled, saturated on write, widened on read."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def to_pool(x: Float[Array, "..."], dtype, scale: float = 1.0) -> Array:
    """K or V as a pool of `dtype` stores them: divided by the pool's scale, and saturated for fp8."""
    if scale != 1.0:
        x = x.astype(jnp.float32) / scale
    if is_fp8(dtype):
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)  # NaN stays NaN; 500 becomes 448, not NaN
    return x.astype(dtype)


def from_pool(pages: Array, scale: float = 1.0) -> Float[Array, "..."]:
    """Pool elements as the float32 K or V they stand for."""
    pages = pages.astype(jnp.float32)
    return pages * scale if scale != 1.0 else pages


def write_kv(
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    slot_mapping: Int[Array, "tokens"],
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[Float[Array, "kv_heads blocks block_size dim"], Float[Array, "kv_heads blocks block_size dim"]]:
    """Scatter the new K/V of a step into their slots (`to_pool`); every other slot is untouched."""
    block_size = k_pages.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_pages = k_pages.at[:, blocks, offsets].set(to_pool(k.swapaxes(0, 1), k_pages.dtype, k_scale))
    v_pages = v_pages.at[:, blocks, offsets].set(to_pool(v.swapaxes(0, 1), v_pages.dtype, v_scale))
    return k_pages, v_pages


def token_request_ids(query_start_loc: Int[Array, "reqs_plus_1"], num_tokens: int) -> tuple[Array, Array]:
    """Request row of each token and whether the token is real (not padding)."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    num_reqs = query_start_loc.shape[0] - 1
    req = jnp.searchsorted(query_start_loc[1:], tokens, side="right").astype(jnp.int32)
    return jnp.minimum(req, num_reqs - 1), tokens < query_start_loc[-1]


def query_tiles(
    query_start_loc: Int[Array, "reqs_plus_1"], num_tokens: int, block_q: int, max_prefill_reqs: int | None = None
) -> tuple[Int[Array, "tiles"], Int[Array, "tiles"]]:
    """The step's (request, tile index within request) pairs, padded with empty tiles of the last row.

    Every token lies in exactly one tile; a tile never spans two requests. There
    are at most num_tokens // block_q + min(reqs, num_tokens) tiles. With
    `max_prefill_reqs`, requests of one token get no tile and at most that many
    requests may have more (the caller's promise): num_tokens // block_q + max_prefill_reqs.
    """
    num_reqs = query_start_loc.shape[0] - 1
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tiles_per_req = (q_lens + block_q - 1) // block_q
    if max_prefill_reqs is None:
        max_tiles = num_tokens // block_q + min(num_reqs, num_tokens)
    else:
        max_tiles = num_tokens // block_q + min(max_prefill_reqs, num_reqs, num_tokens)
        tiles_per_req = jnp.where(q_lens > 1, tiles_per_req, 0)
    tile_ends = jnp.cumsum(tiles_per_req)
    work = jnp.arange(max_tiles, dtype=jnp.int32)
    tile_req = jnp.minimum(jnp.searchsorted(tile_ends, work, side="right"), num_reqs - 1).astype(jnp.int32)
    # Past the last real tile this index runs beyond its request's tiles: the tile has no rows.
    tile_idx = (work - (tile_ends[tile_req] - tiles_per_req[tile_req])).astype(jnp.int32)
    return tile_req, tile_idx


# Bytes of one gathered K tile (query tiles x tile x kv_heads x dim, f32) and the most tokens
# a tile takes. Measured on XLA:CPU with the batched-dot loop body (one layer, float16 pool):
# 64-token tiles were best for 8-16 decodes and for mixed steps (32 query tiles: 2.3 vs 4.5 ms
# at 16 tokens), 32 for 64 decodes and 16 for 256 decodes (larger tiles fall out of cache),
# and 128-token tiles never beat 64.
TILE_BYTES = 2 << 20
MAX_TILE_TOKENS = 64


def default_tile_tokens(num_rows: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """The largest power-of-two number of pages (at most MAX_TILE_TOKENS) whose K tile fits TILE_BYTES."""
    tile = block_size
    while tile * 2 <= MAX_TILE_TOKENS and num_rows * tile * 2 * num_kv_heads * head_dim * 4 <= TILE_BYTES:
        tile *= 2
    return tile


def ragged_paged_attention_reference(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    *,
    block_q: int = 1,
    tile_tokens: int | None = None,
    max_prefill_reqs: int | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "tokens q_heads dim"]:
    """Causal attention of a ragged batch of new tokens over the paged pool.

    Queries go in tiles of `block_q` consecutive tokens of one request (1: every
    token on its own, best for decodes; larger: a prompt chunk's tokens share
    each gathered page, best for prefill). Each query tile walks its request's
    pages with an online softmax, `tile_tokens` KV positions at a time and only
    as far as the longest request, so memory stays O(tiles * tile_tokens)
    whatever max_model_len is. Keys and values past a request's length are
    replaced before use, so NaN garbage in unused pages or the unused tail of a
    page never leaks into the output.

    With `max_prefill_reqs` (block_q > 1 only) requests of one token get no query
    tile and their rows come out 0: `mixed_paged_attention_reference` runs them
    through the decode path instead.

    With `sliding_window` (transformers' semantics) a query at position p sees only
    keys at positions > p - sliding_window, itself included; each query tile starts
    its walk at the first KV tile its window reaches, so the walk's length is
    bounded by the window, not the context.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    query_start_loc = metadata.query_start_loc
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if block_q == 1:
        tile_req, is_real = token_request_ids(query_start_loc, num_tokens)
        tokens = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]  # [W=T, 1]
        row_real = is_real[:, None]
    else:
        tile_req, tile_idx = query_tiles(query_start_loc, num_tokens, block_q, max_prefill_reqs)
        tokens = query_start_loc[tile_req][:, None] + tile_idx[:, None] * block_q + jnp.arange(block_q)  # [W, Bq]
        row_real = tokens < query_start_loc[tile_req + 1][:, None]
    num_tiles_q = tokens.shape[0]
    seq_len = metadata.seq_lens[tile_req]  # [W]
    # Absolute position of each row: its request's first new position + index within the chunk.
    position = (seq_len - q_lens[tile_req] - query_start_loc[tile_req])[:, None] + tokens  # [W, Bq]
    block_table = metadata.block_tables[tile_req]  # [W, max_blocks], padded below to whole tiles
    if tile_tokens is None:
        tile_tokens = default_tile_tokens(num_tiles_q, num_kv_heads, head_dim, block_size)
    pages_per_tile = max(1, tile_tokens // block_size)
    tile = pages_per_tile * block_size
    block_table = jnp.pad(block_table, ((0, 0), (0, -block_table.shape[1] % pages_per_tile)))
    last_table_page = block_table.shape[1] - 1
    end_tile = (seq_len + tile - 1) // tile  # [W]
    if sliding_window is None:
        first_tile = jnp.zeros_like(end_tile)
    else:
        first_pos = jnp.min(jnp.where(row_real, position, jnp.iinfo(jnp.int32).max), axis=1)  # [W]
        first_tile = jnp.minimum(jnp.maximum(first_pos - sliding_window + 1, 0) // tile, end_tile)
    # Everything is kv-head-major, the pool's own order, so no gathered tile is ever transposed.
    qg = q[jnp.minimum(tokens, num_tokens - 1)].astype(jnp.float32) * sm_scale  # [W, Bq, Hq, D]
    qg = qg.reshape(num_tiles_q, block_q, num_kv_heads, group, head_dim).transpose(2, 0, 1, 3, 4)

    def one_tile(j, carry):
        m, l, acc = carry  # [Hkv, W, Bq, G], [Hkv, W, Bq, G], [Hkv, W, Bq, G, D]
        if sliding_window is None:  # every query tile walks tile j: one slice of the tables, not a gather
            pages = jax.lax.dynamic_slice_in_dim(block_table, j * pages_per_tile, pages_per_tile, axis=1)  # [W, P]
            kv_pos = (j * tile + jnp.arange(tile))[None, :]  # [1, tile]
        else:
            kv_tile = first_tile + j  # [W]: each query tile walks from the first KV tile its window reaches
            page_idx = kv_tile[:, None] * pages_per_tile + jnp.arange(pages_per_tile)  # [W, P]
            # Past the table's end every key is past the row's position (masked below), so clamping is safe.
            pages = jnp.take_along_axis(block_table, jnp.minimum(page_idx, last_table_page), axis=1)  # [W, P]
            kv_pos = kv_tile[:, None] * tile + jnp.arange(tile)  # [W, tile]
        k = from_pool(k_pages[:, pages].reshape(num_kv_heads, num_tiles_q, tile, head_dim), k_scale)
        v = from_pool(v_pages[:, pages].reshape(num_kv_heads, num_tiles_q, tile, head_dim), v_scale)
        # Scores of keys past a row's position are masked below, so NaN garbage in K never
        # leaks; V's garbage would (0 * NaN), so V past each request's length is zeroed.
        in_seq = kv_pos < seq_len[:, None]  # [W, tile]
        v = jnp.where(in_seq[None, :, :, None], v, 0.0)
        valid = (kv_pos[:, None, :] <= position[:, :, None]) & row_real[:, :, None]  # [W, Bq, tile]
        if sliding_window is not None:
            valid &= kv_pos[:, None, :] > position[:, :, None] - sliding_window
        # Batched dots (YNNPACK on XLA:CPU), also for one-query tiles: faster per decode layer than
        # the multiply-and-reduce this replaced (`python -m benchmarks.cpu_steps`).
        s = jnp.einsum("kwbgd,kwtd->kwbgt", qg, k)
        s = jnp.where(valid[None, :, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, -jnp.inf) - m_safe)
        l = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum("kwbgt,kwtd->kwbgd", p, v)
        return m_new, l, alpha[..., None] * acc + pv

    shape = (num_kv_heads, num_tiles_q, block_q, group)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    num_kv_tiles = jnp.max(end_tile - first_tile, initial=0)  # a step with no query tiles walks none
    _, l, acc = jax.lax.fori_loop(0, num_kv_tiles, one_tile, init)
    out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).transpose(1, 2, 0, 3, 4)  # [W, Bq, Hkv, G, D]
    out = out.reshape(num_tiles_q * block_q, num_q_heads, head_dim).astype(q.dtype)
    if block_q == 1:
        return out
    # Rows of padding tiles and past a request's chunk go to index num_tokens and are dropped.
    rows = jnp.where(row_real, tokens, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[rows].set(out, mode="drop")


def paged_decode_attention_reference(
    q: Float[Array, "reqs q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    seq_lens: Int[Array, "reqs"],
    block_tables: Int[Array, "reqs max_blocks"],
    sm_scale: float,
    *,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "reqs q_heads dim"]:
    """Decode: one new token per request, attending to all seq_lens[r] cached tokens.

    The ragged reference with every q_len equal to 1; rows with seq_len 0 are
    padding (their token has no key to attend to) and give 0.
    """
    num_reqs = q.shape[0]
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros((num_reqs,), jnp.int32),
        query_start_loc=jnp.arange(num_reqs + 1, dtype=jnp.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
    )
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, metadata, sm_scale, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale
    )


def mixed_paged_attention_reference(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    *,
    block_q: int,
    max_prefill_reqs: int,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Float[Array, "tokens q_heads dim"]:
    """The ragged reference for a step where at most `max_prefill_reqs` requests have 2+ tokens.

    In the plain ragged path every request takes a query tile, so each decode beside
    a prompt chunk pads a tile to block_q rows. Here one-token requests go through
    the decode path (one query row each) and only the prompt chunks get query tiles:
    per layer on XLA:CPU, 64 decodes beside a 448-token chunk ran 15.3 -> 7.0 ms and
    15 decodes beside a 241-token chunk 2.29 -> 1.90 ms.
    """
    num_tokens = q.shape[0]
    query_start_loc = metadata.query_start_loc
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    last_token = jnp.clip(query_start_loc[1:] - 1, 0, num_tokens - 1)
    one_token = q_lens == 1
    decoded = paged_decode_attention_reference(
        q[last_token], k_pages, v_pages, jnp.where(one_token, metadata.seq_lens, 0), metadata.block_tables, sm_scale,
        sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
    )
    prefilled = ragged_paged_attention_reference(
        q, k_pages, v_pages, metadata, sm_scale, block_q=block_q, max_prefill_reqs=max_prefill_reqs,
        sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
    )
    req, is_real = token_request_ids(query_start_loc, num_tokens)
    return jnp.where((one_token[req] & is_real)[:, None, None], decoded[req], prefilled)
