"""Pure pieces of the runner: bucket lists, one-buffer packing, KV pool sizing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cbjax.worker.compilation.buckets import (
    CPU_MIN_DECODE_REQS,
    MIN_ROWS,
    Bucket,
    compute_buckets,
    mixed_token_sizes,
    one_request_buckets,
    pick_bucket,
    step_shapes,
)
from cbjax.worker.packing import PackedLayout, pack, pack_device, unpack, unpack_host


def test_buckets_cover_every_step_and_prune_infeasible_pairs():
    buckets = compute_buckets(max_num_seqs=64, max_num_batched_tokens=512)
    decode = [(b.num_tokens, b.num_reqs) for b in buckets if b.kind == "decode"]
    mixed = [(b.num_tokens, b.num_reqs) for b in buckets if b.kind == "mixed"]
    assert decode == [(8, 8), (16, 16), (32, 32), (64, 64)]
    assert mixed == [(16, 16), (32, 32), (64, 64), (128, 64), (256, 64), (512, 64)]
    assert all(b.num_reqs <= b.num_tokens for b in buckets)
    # A CPU engine's (the C++ kernels': a step's multiply-adds grow with its rows) start at two requests.
    cpu = compute_buckets(max_num_seqs=64, max_num_batched_tokens=512, min_decode_reqs=CPU_MIN_DECODE_REQS)
    assert [(b.num_tokens, b.num_reqs) for b in cpu if b.kind == "decode"] == [(2, 2), (4, 4)] + decode
    assert [b for b in cpu if b.kind == "mixed"] == [b for b in buckets if b.kind == "mixed"]
    # Limits that are not powers of two are buckets themselves, so the largest step always fits.
    odd = compute_buckets(max_num_seqs=12, max_num_batched_tokens=100)
    assert max(b.num_reqs for b in odd if b.kind == "decode") == 12
    assert max(b.num_tokens for b in odd if b.kind == "mixed") == 100
    for num_tokens in range(1, 101):
        for num_reqs in range(1, min(num_tokens, 12) + 1):
            chosen = pick_bucket(odd, "mixed", num_tokens, num_reqs)
            assert chosen.num_tokens >= num_tokens and chosen.num_reqs >= num_reqs


def test_decode_and_mixed_buckets_of_one_shape_share_an_executable_where_attention_runs_them_alike():
    buckets = compute_buckets(max_num_seqs=64, max_num_batched_tokens=512)
    shared = step_shapes(buckets, decode_runs_as_mixed=True)
    # Hand-worked: decode 16/32/64 rows have the shapes of the mixed 16/32/64-token buckets.
    assert sorted({(b.num_tokens, b.num_reqs) for b in shared.values()}) == [
        (8, 8), (16, 16), (32, 32), (64, 64), (128, 64), (256, 64), (512, 64)
    ]
    for n in (16, 32, 64):
        assert shared[Bucket("mixed", n, n)] == shared[Bucket("decode", n, n)] == Bucket("decode", n, n)
    assert all(shared[b] == b for b in buckets if b.num_tokens > 64 or b.num_tokens == 8)
    # Where decode steps have an attention path of their own, every bucket is its own program.
    assert step_shapes(buckets, decode_runs_as_mixed=False) == {b: b for b in buckets}


def test_one_request_needs_the_buckets_of_its_prompt_chunks_and_of_decoding():
    buckets = compute_buckets(max_num_seqs=1, max_num_batched_tokens=128)  # `cbjax generate`'s engine
    assert [(b.kind, b.num_tokens) for b in buckets] == [("decode", 2), ("mixed", 16), ("mixed", 32), ("mixed", 64), ("mixed", 128)]
    # Hand-worked: a 40-token prompt is one chunk (64-token bucket); 300 tokens are 128 + 128 + 44 (64).
    assert one_request_buckets(buckets, 40, 128) == [Bucket("decode", 2, 2), Bucket("mixed", 64, 2)]
    assert one_request_buckets(buckets, 300, 128) == [Bucket("decode", 2, 2), Bucket("mixed", 64, 2), Bucket("mixed", 128, 2)]
    # A one-token last chunk (129 = 128 + 1) is a decode-only step.
    assert one_request_buckets(buckets, 129, 128) == [Bucket("decode", 2, 2), Bucket("mixed", 128, 2)]


def test_a_lone_request_runs_in_a_two_row_step():
    """One-row bf16 dots are several times slower on XLA:CPU than two-row ones: no bucket has one row."""
    assert MIN_ROWS == 2
    for max_num_seqs, max_num_batched_tokens in [(1, 1), (1, 512), (2, 2), (3, 16)]:
        buckets = compute_buckets(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        assert min(min(b.num_tokens, b.num_reqs) for b in buckets) == max(2, max_num_seqs)
        assert all(b.num_reqs <= b.num_tokens for b in buckets)
        assert pick_bucket(buckets, "decode", 1, 1).num_reqs == max(2, max_num_seqs)
        assert pick_bucket(buckets, "mixed", 1, 1).num_reqs == max(2, max_num_seqs)
        top = max(b.num_tokens for b in buckets if b.kind == "mixed")
        assert top == max(2, max_num_batched_tokens)


def test_mixed_token_sizes_add_the_midpoint_of_each_doubling_from_64_tokens():
    # Hand-worked: powers of two from 16, plus 1.5x each power of two from 64 whose double is in the list.
    assert mixed_token_sizes(16, 512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert mixed_token_sizes(16, 2048)[-4:] == [768, 1024, 1536, 2048]
    # A last step to a limit that is no doubling (64 -> 100) gets no midpoint: 96 would be nearly 100.
    assert mixed_token_sizes(16, 100) == [16, 32, 64, 100]
    assert mixed_token_sizes(12, 200) == [12, 24, 48, 96, 144, 192, 200]
    assert mixed_token_sizes(16, 64) == [16, 32, 64]


def test_a_prompt_step_pads_at_most_a_third_of_its_rows_from_64_tokens():
    """The section 9 profile's typical prompt step (173 tokens) ran in a 256-token bucket; with the
    midpoints in 192. Without them (the default) the buckets are powers of two."""
    assert [b.num_tokens for b in compute_buckets(16, 512) if b.kind == "mixed"] == [16, 32, 64, 128, 256, 512]
    buckets = compute_buckets(max_num_seqs=16, max_num_batched_tokens=512, midpoints=True)
    assert pick_bucket(buckets, "mixed", 173, 16) == Bucket("mixed", 192, 16)
    for num_tokens in range(65, 513):
        chosen = pick_bucket(buckets, "mixed", num_tokens, 16).num_tokens
        assert chosen >= num_tokens and (chosen - num_tokens) * 3 < chosen


def test_verifying_steps_get_buckets_of_their_own_size_only_with_speculation():
    plain = compute_buckets(max_num_seqs=32, max_num_batched_tokens=256)
    buckets = compute_buckets(max_num_seqs=32, max_num_batched_tokens=256, verify_rows=4, num_speculative_tokens=4)
    assert sorted(set(buckets) - set(plain)) == [Bucket("mixed", 5, 2), Bucket("mixed", 10, 2), Bucket("mixed", 20, 4)]
    assert pick_bucket(buckets, "mixed", 5, 1) == Bucket("mixed", 5, 2)  # one request's newest token and 4 drafts
    assert pick_bucket(buckets, "mixed", 4 + 4 + 1, 3) == Bucket("mixed", 16, 16)  # beside a decode: the fewer tokens
    assert pick_bucket(plain, "mixed", 5, 1) == Bucket("mixed", 16, 16)
    small = compute_buckets(max_num_seqs=4, max_num_batched_tokens=16, verify_rows=4, num_speculative_tokens=4)
    assert [b for b in small if b.kind == "mixed"] == [Bucket("mixed", 5, 2), Bucket("mixed", 10, 2), Bucket("mixed", 16, 4)]


def test_pick_bucket_takes_the_smallest_that_fits_and_explains_a_miss():
    buckets = compute_buckets(max_num_seqs=64, max_num_batched_tokens=512)
    assert pick_bucket(buckets, "decode", 9, 9) == Bucket("decode", 16, 16)
    assert pick_bucket(buckets, "mixed", 100, 3) == Bucket("mixed", 128, 64)
    assert pick_bucket(buckets, "mixed", 90, 3) == Bucket("mixed", 128, 64)
    assert pick_bucket(buckets, "mixed", 9, 9) == Bucket("mixed", 16, 16)
    with pytest.raises(ValueError, match="no mixed bucket holds 513 tokens"):
        pick_bucket(buckets, "mixed", 513, 1)


def test_packing_round_trips_ints_and_floats_through_one_buffer():
    rng = np.random.default_rng(0)
    tree = {
        "ids": rng.integers(-5, 5, (3, 4)).astype(np.int32),
        "temps": rng.normal(size=(7,)).astype(np.float32),
        "seeds": rng.integers(0, 2**32, (2,), dtype=np.uint64).astype(np.uint32),
    }
    layout = PackedLayout.of(tree)
    flat = pack(tree)
    assert flat.dtype == np.int32 and flat.shape == (layout.size,) == (12 + 7 + 2,)
    on_device = jax.jit(lambda f: unpack(f, layout))(flat)
    for name in tree:
        np.testing.assert_array_equal(np.asarray(on_device[name]), tree[name])
    back = unpack_host(np.asarray(jax.jit(pack_device)(on_device)), layout)
    for name in tree:
        np.testing.assert_array_equal(back[name], tree[name])


def test_packing_refuses_leaves_that_are_not_32_bit():
    with pytest.raises(TypeError, match="32-bit"):
        PackedLayout.of({"x": np.zeros(3, np.int64)})
