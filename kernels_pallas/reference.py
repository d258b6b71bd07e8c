"""Plain-jnp references of every attention kernel, and the contract they share.

KV pool layout (one pair of arrays per layer):

    k_pages, v_pages: [num_kv_heads, num_blocks, block_size, head_dim]

Block 0 is the null block: padded block-table entries point at it and padded
tokens write into it, so its contents are garbage and are never read unmasked.
A token's *slot* is `block_id * block_size + offset_in_block`.

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


def write_kv(
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    k: Float[Array, "tokens kv_heads dim"],
    v: Float[Array, "tokens kv_heads dim"],
    slot_mapping: Int[Array, "tokens"],
) -> tuple[Float[Array, "kv_heads blocks block_size dim"], Float[Array, "kv_heads blocks block_size dim"]]:
    """Scatter the new K/V of a step into their slots; every other slot is untouched."""
    block_size = k_pages.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_pages = k_pages.at[:, blocks, offsets].set(k.swapaxes(0, 1).astype(k_pages.dtype))
    v_pages = v_pages.at[:, blocks, offsets].set(v.swapaxes(0, 1).astype(v_pages.dtype))
    return k_pages, v_pages


def token_request_ids(query_start_loc: Int[Array, "reqs_plus_1"], num_tokens: int) -> tuple[Array, Array]:
    """Request row of each token and whether the token is real (not padding)."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    num_reqs = query_start_loc.shape[0] - 1
    req = jnp.searchsorted(query_start_loc[1:], tokens, side="right").astype(jnp.int32)
    return jnp.minimum(req, num_reqs - 1), tokens < query_start_loc[-1]


# Bytes of one gathered K tile (tokens x tile x kv_heads x dim, f32). Measured on XLA:CPU: tiles
# past this fall out of cache (256 decodes x 128-token tiles ran 6x slower than 16-token ones),
# while below it fewer, larger tiles save loop iterations.
TILE_BYTES = 1 << 20


def default_tile_tokens(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """The largest power-of-two number of pages (at most 128 tokens) whose K tile fits TILE_BYTES."""
    tile = block_size
    while tile * 2 <= 128 and num_tokens * tile * 2 * num_kv_heads * head_dim * 4 <= TILE_BYTES:
        tile *= 2
    return tile


def ragged_paged_attention_reference(
    q: Float[Array, "tokens q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    metadata: AttentionMetadata,
    sm_scale: float,
    *,
    tile_tokens: int | None = None,
) -> Float[Array, "tokens q_heads dim"]:
    """Causal attention of a ragged batch of new tokens over the paged pool.

    Walks the pages with an online softmax, a tile of `tile_tokens` KV
    positions at a time and only as far as the longest request, so memory stays
    O(tokens * tile_tokens) whatever max_model_len is. Masked keys and values
    are replaced before use, so NaN garbage in unused pages or the unused tail
    of a page never leaks into the output.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    req, is_real = token_request_ids(metadata.query_start_loc, num_tokens)
    q_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    seq_len = metadata.seq_lens[req]
    # Absolute position of each token: its request's first new position + index within the chunk.
    position = seq_len - q_lens[req] + (jnp.arange(num_tokens) - metadata.query_start_loc[req])
    if tile_tokens is None:
        tile_tokens = default_tile_tokens(num_tokens, num_kv_heads, head_dim, block_size)
    pages_per_tile = max(1, tile_tokens // block_size)
    tile = pages_per_tile * block_size
    block_table = metadata.block_tables[req]  # [T, max_blocks], padded below to whole tiles
    block_table = jnp.pad(block_table, ((0, 0), (0, -block_table.shape[1] % pages_per_tile)))
    # Everything is kv-head-major, the pool's own order, so no gathered tile is ever transposed.
    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim).swapaxes(0, 1)

    def one_tile(j, carry):
        m, l, acc = carry  # [Hkv, T, G], [Hkv, T, G], [Hkv, T, G, D]
        pages = jax.lax.dynamic_slice_in_dim(block_table, j * pages_per_tile, pages_per_tile, axis=1)  # [T, P]
        k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, tile, head_dim).astype(jnp.float32)
        v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, tile, head_dim).astype(jnp.float32)
        kv_pos = j * tile + jnp.arange(tile)
        valid = (kv_pos[None, :] <= position[:, None]) & is_real[:, None]  # [T, tile]
        k = jnp.where(valid[None, :, :, None], k, 0.0)
        v = jnp.where(valid[None, :, :, None], v, 0.0)
        # Multiply-and-reduce rather than a dot: XLA:CPU fuses it with the page gather into one
        # loop, where a dot would first materialize the gathered tile.
        s = jnp.sum(qg[:, :, :, None, :] * k[:, :, None, :, :], axis=-1)  # [Hkv, T, G, tile]
        s = jnp.where(valid[None, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, -jnp.inf) - m_safe)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.sum(p[..., None] * v[:, :, None, :, :], axis=-2)
        return m_new, l, acc

    init = (
        jnp.full((num_kv_heads, num_tokens, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_kv_heads, num_tokens, group), jnp.float32),
        jnp.zeros((num_kv_heads, num_tokens, group, head_dim), jnp.float32),
    )
    num_tiles = (jnp.max(metadata.seq_lens) + tile - 1) // tile
    _, l, acc = jax.lax.fori_loop(0, num_tiles, one_tile, init)
    out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).swapaxes(0, 1)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def paged_decode_attention_reference(
    q: Float[Array, "reqs q_heads dim"],
    k_pages: Float[Array, "kv_heads blocks block_size dim"],
    v_pages: Float[Array, "kv_heads blocks block_size dim"],
    seq_lens: Int[Array, "reqs"],
    block_tables: Int[Array, "reqs max_blocks"],
    sm_scale: float,
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
    return ragged_paged_attention_reference(q, k_pages, v_pages, metadata, sm_scale)
