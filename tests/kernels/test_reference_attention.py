"""The jnp reference of paged attention against dense attention written out per request in numpy."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kernels_pallas.reference import (
    AttentionMetadata,
    mixed_paged_attention_reference,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
)


def dense_attention(q, keys, values, scale, num_kv_heads, window=None):
    """q [n, Hq, D] are the last n of len(keys) positions; causal; GQA by repeating kv heads.

    With `window`, transformers' sliding-window mask (masking_utils.sliding_window_overlay):
    query position p sees key position k iff k > p - window.
    """
    n, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, keys) * scale
    first = len(keys) - n
    key_pos, query_pos = np.arange(len(keys))[None, :], (first + np.arange(n))[:, None]
    causal = key_pos <= query_pos
    if window is not None:
        causal &= key_pos > query_pos - window
    scores = np.where(causal[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, values)


def build_batch(rng, requests, num_kv_heads, num_q_heads, head_dim, block_size, num_blocks, max_blocks, num_tokens, num_reqs,
                window=None):
    """Pool filled with NaN except the requests' tokens, on shuffled pages; padded metadata."""
    k_pages = np.full((num_kv_heads, num_blocks, block_size, head_dim), np.nan, np.float32)
    v_pages = k_pages.copy()
    free = list(rng.permutation(np.arange(1, num_blocks)))
    block_tables = np.zeros((num_reqs, max_blocks), np.int32)
    query_start_loc = np.zeros(num_reqs + 1, np.int32)
    seq_lens = np.zeros(num_reqs, np.int32)
    q = rng.normal(size=(num_tokens, num_q_heads, head_dim)).astype(np.float32)
    expected = np.zeros_like(q)
    offset = 0
    for r, (q_len, seq_len) in enumerate(requests):
        pages = [free.pop() for _ in range(-(-seq_len // block_size))]
        block_tables[r, : len(pages)] = pages
        keys = rng.normal(size=(seq_len, num_kv_heads, head_dim)).astype(np.float32)
        values = rng.normal(size=(seq_len, num_kv_heads, head_dim)).astype(np.float32)
        for pos in range(seq_len):
            k_pages[:, pages[pos // block_size], pos % block_size] = keys[pos]
            v_pages[:, pages[pos // block_size], pos % block_size] = values[pos]
        expected[offset : offset + q_len] = dense_attention(q[offset : offset + q_len], keys, values, head_dim**-0.5, num_kv_heads, window)
        offset += q_len
        query_start_loc[r + 1] = offset
        seq_lens[r] = seq_len
    query_start_loc[len(requests) + 1 :] = offset
    metadata = AttentionMetadata(np.zeros(num_tokens, np.int32), query_start_loc, seq_lens, block_tables)
    q, k_pages, v_pages, metadata = jax.device_put((q, k_pages, v_pages, metadata))
    return q, k_pages, v_pages, metadata, expected


@pytest.mark.parametrize("block_q", [1, 4, 16])
@pytest.mark.parametrize("tile_tokens", [4, 8, 24, 128])
def test_ragged_reference_equals_dense_attention_per_request(tile_tokens, block_q):
    rng = np.random.default_rng(tile_tokens)
    # (new tokens, KV length): prefill, chunk over a cached prefix, decodes at block edges, one token.
    requests = [(9, 9), (5, 21), (1, 8), (1, 17), (1, 1), (3, 40)]
    q, k_pages, v_pages, metadata, expected = build_batch(
        rng, requests, num_kv_heads=2, num_q_heads=6, head_dim=16, block_size=8, num_blocks=24,
        max_blocks=6, num_tokens=24, num_reqs=8,
    )
    out = np.asarray(jax.jit(functools.partial(
        ragged_paged_attention_reference, sm_scale=16**-0.5, tile_tokens=tile_tokens, block_q=block_q
    ))(q, k_pages, v_pages, metadata))
    np.testing.assert_allclose(out, expected, atol=2e-5)
    assert not out[20:].any()  # padding tokens give 0


def test_decode_reference_equals_dense_attention_and_padded_rows_give_zero():
    rng = np.random.default_rng(0)
    requests = [(1, n) for n in (1, 7, 8, 9, 33)]
    q, k_pages, v_pages, metadata, expected = build_batch(
        rng, requests, num_kv_heads=1, num_q_heads=4, head_dim=32, block_size=8, num_blocks=16,
        max_blocks=5, num_tokens=6, num_reqs=6,
    )
    decode = jax.jit(functools.partial(paged_decode_attention_reference, sm_scale=32**-0.5))
    out = np.asarray(decode(q, k_pages, v_pages, metadata.seq_lens, metadata.block_tables))
    np.testing.assert_allclose(out[:5], expected[:5], atol=2e-5)
    assert not out[5].any()


@pytest.mark.parametrize("block_q", [4, 16])
@pytest.mark.parametrize("requests, max_prefill_reqs", [
    # decodes at block edges and a one-token prompt remainder beside two chunks (one over a prefix)
    ([(1, 8), (9, 9), (1, 17), (1, 1), (5, 21), (1, 33)], 2),
    ([(1, 8), (9, 9), (1, 17), (1, 1), (5, 21), (1, 33)], 6),
    ([(16, 16)], 1),  # one chunk alone, a whole number of query tiles
    ([(1, n) for n in (1, 7, 8, 9, 40)], 1),  # no chunk at all
])
def test_mixed_reference_runs_one_token_requests_through_the_decode_path(block_q, requests, max_prefill_reqs):
    rng = np.random.default_rng(block_q + max_prefill_reqs)
    num_tokens = sum(q_len for q_len, _ in requests) + 3  # three padding tokens
    q, k_pages, v_pages, metadata, expected = build_batch(
        rng, requests, num_kv_heads=2, num_q_heads=6, head_dim=16, block_size=8, num_blocks=40,
        max_blocks=6, num_tokens=num_tokens, num_reqs=len(requests) + 2,
    )
    out = np.asarray(jax.jit(functools.partial(
        mixed_paged_attention_reference, sm_scale=16**-0.5, block_q=block_q, max_prefill_reqs=max_prefill_reqs
    ))(q, k_pages, v_pages, metadata))
    np.testing.assert_allclose(out, expected, atol=2e-5)
    assert not out[-3:].any()  # padding tokens give 0


# Window edges: one token (itself only), one block, not a block multiple, longer than every sequence.
@pytest.mark.parametrize("window", [1, 8, 13, 64])
@pytest.mark.parametrize("block_q", [1, 4])
def test_windowed_reference_equals_dense_windowed_attention(window, block_q):
    rng = np.random.default_rng(window + block_q)
    requests = [(9, 9), (5, 21), (1, 8), (1, 17), (1, 1), (3, 40)]
    q, k_pages, v_pages, metadata, expected = build_batch(
        rng, requests, num_kv_heads=2, num_q_heads=6, head_dim=16, block_size=8, num_blocks=24,
        max_blocks=6, num_tokens=24, num_reqs=8, window=window,
    )
    out = np.asarray(jax.jit(functools.partial(
        ragged_paged_attention_reference, sm_scale=16**-0.5, tile_tokens=8, block_q=block_q, sliding_window=window
    ))(q, k_pages, v_pages, metadata))
    np.testing.assert_allclose(out, expected, atol=2e-5)
    assert not out[20:].any()


@pytest.mark.parametrize("window", [1, 8, 13])
def test_windowed_decode_and_mixed_references_equal_dense_windowed_attention(window):
    rng = np.random.default_rng(window)
    requests = [(1, 8), (9, 9), (1, 17), (1, 1), (5, 21), (1, 33)]
    q, k_pages, v_pages, metadata, expected = build_batch(
        rng, requests, num_kv_heads=2, num_q_heads=6, head_dim=16, block_size=8, num_blocks=40,
        max_blocks=6, num_tokens=21, num_reqs=8, window=window,
    )
    mixed = jax.jit(functools.partial(
        mixed_paged_attention_reference, sm_scale=16**-0.5, block_q=4, max_prefill_reqs=2, sliding_window=window
    ))
    np.testing.assert_allclose(np.asarray(mixed(q, k_pages, v_pages, metadata)), expected, atol=2e-5)
    last = np.asarray(metadata.query_start_loc)[1:7] - 1
    decode = jax.jit(functools.partial(paged_decode_attention_reference, sm_scale=16**-0.5, sliding_window=window))
    decoded = np.asarray(decode(q[last], k_pages, v_pages, metadata.seq_lens[:6], metadata.block_tables[:6]))
    np.testing.assert_allclose(decoded, expected[last], atol=2e-5)


def test_windowed_reference_walks_only_the_window_not_the_context():
    """A decode at position 799 with window 16 reads only pages 98-99 (positions 784-799): the rest hold NaN."""
    rng = np.random.default_rng(1)
    q, k_pages, v_pages, metadata, expected = build_batch(
        rng, [(1, 800)], num_kv_heads=1, num_q_heads=2, head_dim=8, block_size=8, num_blocks=101,
        max_blocks=100, num_tokens=1, num_reqs=1, window=16,
    )
    table = np.asarray(metadata.block_tables)[0]
    k_pages = k_pages.at[:, table[:98]].set(np.nan)  # every page the window does not reach
    v_pages = v_pages.at[:, table[:98]].set(np.nan)
    decode = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=8**-0.5, tile_tokens=8, sliding_window=16))
    out = np.asarray(decode(q, k_pages, v_pages, metadata))
    np.testing.assert_allclose(out, expected, atol=2e-5)
