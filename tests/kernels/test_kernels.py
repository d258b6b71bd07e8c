"""The Pallas kernels equal their jnp references, interpreted on CPU and compiled on a GPU.

Every case fills the null block, unused pages and the unused tail of each last
page with NaN, so a kernel that reads anything it should not gives NaN. Each
dimension of the issue is covered by some case, not the full cross product:
lengths 0, 1, bs-1, bs, bs+1 and the maximum sit in every batch; GQA ratio,
head_dim, block size, dtype, split-K and tile sizes vary across the cases.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.models.layers.attention import AttentionPlan, attention, resolve_backend
from kernels_pallas.paged_attention import paged_decode_attention
from kernels_pallas.ragged_attention import query_tiles, ragged_paged_attention
from kernels_pallas.reference import (
    AttentionMetadata,
    paged_decode_attention_reference,
    ragged_paged_attention_reference,
    write_kv,
)

MAX_BLOCKS = 4  # pages per request in every case: the maximum length is 4 * block_size
SM_SCALE = 0.3


@dataclasses.dataclass(frozen=True)
class Case:
    block_size: int
    head_dim: int
    group: int  # query heads per KV head
    dtype: str
    num_kv_heads: int = 2
    tiles: dict = dataclasses.field(default_factory=dict)  # kernel tiling keywords
    kv_dtype: str | None = None  # the pool's, when it differs from q's (kv_cache_dtype)
    k_scale: float = 1.0  # what a pool element stands for, times the element (fp8 pools)
    v_scale: float = 1.0

    def __str__(self) -> str:
        tiles = "".join(f"-{k}{v}" for k, v in self.tiles.items())
        pool = f"-pool_{self.kv_dtype}" if self.kv_dtype else ""
        scales = f"-scales{self.k_scale}_{self.v_scale}" if self.scales != SCALES_OF_FLOAT_POOLS else ""
        return f"bs{self.block_size}-d{self.head_dim}-g{self.group}-{self.dtype}{pool}{scales}-kv{self.num_kv_heads}{tiles}"

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    @property
    def tolerance(self) -> float:
        """That of the least precise of q's and the pool's types."""
        return max(TOLERANCE[self.dtype], TOLERANCE[self.kv_dtype or self.dtype])


SCALES_OF_FLOAT_POOLS = {"k_scale": 1.0, "v_scale": 1.0}
DECODE_CASES = [
    Case(8, 16, 1, "float32", tiles={"num_splits": 1}),
    Case(16, 32, 2, "bfloat16"),  # default split-K and tile
    Case(32, 64, 4, "float32", tiles={"num_splits": 3}),
    Case(16, 128, 8, "bfloat16", num_kv_heads=1, tiles={"num_splits": 2}),
    Case(8, 64, 3, "bfloat16", num_kv_heads=3, tiles={"num_splits": 1}),  # SmolLM2's 9 q / 3 kv heads
    Case(16, 16, 4, "float32", tiles={"pages_per_tile": 2, "num_splits": 2}),
    Case(16, 32, 2, "bfloat16", kv_dtype="float16"),  # an f16 pool under bf16 activations
    Case(8, 16, 1, "float32", kv_dtype="float16", tiles={"num_splits": 1}),
    # An fp8 pool under bf16 activations, scales applied on the way out of the pool.
    Case(16, 32, 2, "bfloat16", kv_dtype="float8_e4m3fn", k_scale=0.05, v_scale=4.0, tiles={"num_splits": 2}),
]
RAGGED_CASES = [
    Case(8, 16, 1, "float32"),
    Case(16, 32, 2, "bfloat16"),
    Case(32, 64, 4, "float32", tiles={"block_q": 4}),  # many query tiles per prefill chunk
    Case(16, 128, 8, "bfloat16", num_kv_heads=1),
    Case(8, 64, 3, "bfloat16"),
    Case(16, 16, 4, "float32", tiles={"pages_per_tile": 2, "block_q": 8}),
    Case(16, 32, 2, "bfloat16", kv_dtype="float16"),
    Case(8, 16, 1, "float32", kv_dtype="float16"),
    Case(8, 64, 3, "float32", num_kv_heads=3, kv_dtype="float8_e4m3fn", k_scale=0.05, v_scale=4.0),
]
# fp8: kernel and reference widen the same e4m3 elements exactly, so only q's type and the v_scale'd sums differ.
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2, "float8_e4m3fn": 1e-4}


def fill_pool(
    rng: np.random.Generator, case: Case, seq_lens: list[int]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pools of NaN with each request's first seq_len slots (on shuffled pages) set to random values."""
    num_blocks = 1 + len(seq_lens) * MAX_BLOCKS
    shape = (case.num_kv_heads, num_blocks, case.block_size, case.head_dim)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    block_tables = np.zeros((len(seq_lens), MAX_BLOCKS), np.int32)
    free_blocks = iter(rng.permutation(np.arange(1, num_blocks)))  # block 0 is the null block
    for req, seq_len in enumerate(seq_lens):
        for page in range(-(-seq_len // case.block_size)):
            block = next(free_blocks)
            block_tables[req, page] = block
            used = min(case.block_size, seq_len - page * case.block_size)
            k_pages[:, block, :used] = rng.normal(size=(case.num_kv_heads, used, case.head_dim))
            v_pages[:, block, :used] = rng.normal(size=(case.num_kv_heads, used, case.head_dim))
    dtype = jnp.dtype(case.kv_dtype or case.dtype)
    return jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(block_tables)


def random_q(rng: np.random.Generator, case: Case, num_tokens: int) -> jax.Array:
    q = rng.normal(size=(num_tokens, case.num_kv_heads * case.group, case.head_dim))
    return jnp.asarray(q, jnp.dtype(case.dtype))


def decode_lengths(block_size: int) -> list[int]:
    return [0, 1, block_size - 1, block_size, block_size + 1, MAX_BLOCKS * block_size]


def mixed_batch(block_size: int) -> tuple[list[int], list[int], int]:
    """(q_lens, seq_lens, num_tokens): prefills from scratch, chunks over a cached prefix,
    decodes, a padded request row and padding tokens, at lengths 1, bs-1, bs, bs+1 and the maximum."""
    max_len = MAX_BLOCKS * block_size
    requests = [  # (q_len, seq_len)
        (1, 1),  # first token of a one-token prompt
        (block_size - 1, block_size - 1),  # whole prompt in one chunk
        (1, block_size),  # decode
        (3, block_size + 1),  # chunk over a cached prefix of bs - 2
        (block_size + 1, max_len),  # last chunk reaching the maximum length
        (1, max_len),  # decode at the maximum length
        (0, 0),  # padded request row
    ]
    q_lens, seq_lens = zip(*requests)
    return list(q_lens), list(seq_lens), sum(q_lens) + 3


def ragged_metadata(q_lens: list[int], seq_lens: list[int], block_tables: jax.Array, num_tokens: int):
    return AttentionMetadata(
        slot_mapping=jnp.zeros((num_tokens,), jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        block_tables=block_tables,
    )


def assert_matches(out: jax.Array, ref: jax.Array, tolerance: float) -> None:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "kernel output has NaN/inf: it read garbage it should have masked"
    np.testing.assert_allclose(out, ref, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "interpret", [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
)
class TestKernelsEqualReference:
    @pytest.mark.parametrize("case", DECODE_CASES, ids=str)
    def test_decode_kernel_equals_reference(self, case: Case, interpret: bool):
        rng = np.random.default_rng(0)
        seq_lens = decode_lengths(case.block_size)
        k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
        q = random_q(rng, case, len(seq_lens))
        seq_lens = jnp.asarray(seq_lens, jnp.int32)
        out = paged_decode_attention(
            q, k_pages, v_pages, seq_lens, block_tables, SM_SCALE, interpret=interpret, **case.tiles, **case.scales
        )
        ref = paged_decode_attention_reference(q, k_pages, v_pages, seq_lens, block_tables, SM_SCALE, **case.scales)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert_matches(out, ref, case.tolerance)
        assert not np.asarray(out[0]).any(), "a request with seq_len 0 must give 0"

    @pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
    def test_ragged_kernel_equals_reference(self, case: Case, interpret: bool):
        rng = np.random.default_rng(1)
        q_lens, seq_lens, num_tokens = mixed_batch(case.block_size)
        k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
        q = random_q(rng, case, num_tokens)
        metadata = ragged_metadata(q_lens, seq_lens, block_tables, num_tokens)
        out = ragged_paged_attention(
            q, k_pages, v_pages, metadata, SM_SCALE, interpret=interpret, **case.tiles, **case.scales
        )
        ref = ragged_paged_attention_reference(q, k_pages, v_pages, metadata, SM_SCALE, **case.scales)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert_matches(out, ref, case.tolerance)
        assert not np.asarray(out[sum(q_lens) :]).any(), "padding tokens must give 0"


@settings(max_examples=50, deadline=None)
@given(
    q_lens=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    block_q=st.sampled_from([1, 4, 16]),
)
def test_query_tiles_cover_every_token_once(q_lens: list[int], block_q: int):
    num_reqs, num_tokens = 6, 6 * 40 + 3  # fixed bucket shapes: one compilation per block_q
    q_lens = q_lens + [0] * (num_reqs - len(q_lens))
    query_start_loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    tile_req, tile_idx = map(np.asarray, query_tiles(query_start_loc, num_tokens, block_q))
    covered = []
    for req, tile in zip(tile_req, tile_idx):
        first = tile * block_q
        covered += [(req, i) for i in range(first, min(first + block_q, q_lens[req]))]
    assert sorted(covered) == [(r, i) for r, q_len in enumerate(q_lens) for i in range(q_len)]


@pytest.mark.parametrize("dtype, bits", [(jnp.float32, np.uint32), (jnp.bfloat16, np.uint16)], ids=["f32", "bf16"])
def test_kv_write_leaves_every_other_slot_bit_identical(dtype, bits):
    rng = np.random.default_rng(2)
    num_kv_heads, num_blocks, block_size, head_dim = 2, 9, 8, 16
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    # Every bit pattern: NaN payloads, infinities, -0 and subnormals must all come back unchanged.
    pools_bits = [rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits) for _ in "kv"]
    k_pages, v_pages = (jax.lax.bitcast_convert_type(jnp.asarray(b), dtype) for b in pools_bits)
    real_slots = rng.choice(np.arange(block_size, num_blocks * block_size), size=13, replace=False)
    slot_mapping = jnp.asarray(np.concatenate([real_slots, [0, 0, 1]]), jnp.int32)  # padding -> null block
    k = jnp.asarray(rng.normal(size=(16, num_kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(16, num_kv_heads, head_dim)), jnp.float32)

    written = jax.jit(write_kv, donate_argnums=(0, 1))(k_pages, v_pages, k, v, slot_mapping)
    untouched = np.ones((num_blocks * block_size,), bool)
    untouched[np.asarray(slot_mapping)] = False
    untouched = untouched.reshape(num_blocks, block_size)
    blocks, offsets = real_slots // block_size, real_slots % block_size
    for before_bits, after, new in zip(pools_bits, written, (k, v)):
        after_bits = np.asarray(jax.lax.bitcast_convert_type(after, bits))[:, untouched]
        before_bits = before_bits[:, untouched]
        if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
            # XLA:CPU computes bf16 in f32, which canonicalises NaN payloads; any other value must be exact.
            was_nan = np.isnan(np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(before_bits), dtype), np.float32))
            assert np.isnan(np.asarray(after, np.float32)[:, untouched][was_nan]).all()
            after_bits, before_bits = after_bits[~was_nan], before_bits[~was_nan]
        np.testing.assert_array_equal(after_bits, before_bits)
        expected = np.asarray(new[: len(real_slots)].astype(dtype).swapaxes(0, 1))
        np.testing.assert_array_equal(np.asarray(after[:, blocks, offsets]), expected)


def test_fp8_write_divides_by_the_scale_rounds_to_even_and_saturates():
    """Hand-worked e4m3fn (3 mantissa bits, largest 448, subnormal step 2^-9) at k_scale 0.5, v_scale 2."""
    k = jnp.asarray([0.53125, 0.59375, 300.0, -1e4, jnp.nan, 0.0008, 0.25, -0.0], jnp.float32)
    # k / 0.5: 1.0625 ties to 1.0 (even), 1.1875 to 1.25, 600 and -2e4 saturate, NaN stays, 0.0016 is 0.82
    # subnormal steps of 2^-9: one step; 0.5 is exact, -0 keeps its sign.
    want_k = [1.0, 1.25, 448.0, -448.0, np.nan, 2.0**-9, 0.5, -0.0]
    pool = jnp.zeros((1, 2, 8, 1), jnp.float8_e4m3fn)
    slots = jnp.arange(8, 16, dtype=jnp.int32)
    k_pages, v_pages = write_kv(pool, pool, k[:, None, None], k[:, None, None] * 4, slots, k_scale=0.5, v_scale=2.0)
    np.testing.assert_array_equal(np.asarray(k_pages[0, 1, :, 0], np.float32), want_k)
    assert np.signbit(np.asarray(k_pages[0, 1, 7, 0], np.float32))
    # V = 4k at scale 2 stores 2k: the same elements.
    np.testing.assert_array_equal(np.asarray(v_pages[0, 1, :, 0], np.float32), want_k)


@pytest.mark.parametrize(
    "dtype",
    # XLA:CPU emulates bf16 scatters in f32 (it converts the whole pool), so only a GPU shows bf16 in place.
    [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16", marks=pytest.mark.gpu)],
)
def test_kv_write_updates_a_donated_pool_in_place(dtype):
    pool = jax.ShapeDtypeStruct((8, 256, 16, 128), dtype)
    new = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((64,), jnp.int32)
    compiled = jax.jit(write_kv, donate_argnums=(0, 1)).lower(pool, pool, new, new, slots).compile()
    memory = compiled.memory_analysis()
    pool_bytes = np.prod(pool.shape) * jnp.dtype(dtype).itemsize
    assert memory.temp_size_in_bytes < pool_bytes // 8, "write_kv copies the pool instead of updating it"
    assert memory.alias_size_in_bytes >= 2 * pool_bytes, "the donated pools are not aliased to the outputs"


@pytest.mark.skipif(has_gpu(), reason="checks the choice on a machine without a GPU")
def test_pallas_runs_interpreted_without_a_gpu():
    with pytest.warns(RuntimeWarning, match="run interpreted"):
        assert resolve_backend.__wrapped__("pallas") == "pallas_interpret"
    with pytest.raises(ValueError, match="is not one of"):
        resolve_backend("triton")


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_interpreted_backend_equals_xla_backend(decode_only: bool):
    rng = np.random.default_rng(3)
    case = Case(8, 32, 2, "float32")
    q_lens, seq_lens, num_tokens = ([1] * 4, [1, 7, 9, 32], 4) if decode_only else mixed_batch(8)
    k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
    q = random_q(rng, case, num_tokens)
    metadata = ragged_metadata(q_lens, seq_lens, block_tables, num_tokens)
    outs = [
        attention(q, k_pages, v_pages, metadata, SM_SCALE, AttentionPlan(backend, decode_only))
        for backend in ("pallas_interpret", "xla")
    ]
    assert_matches(*outs, case.tolerance)


WINDOWS = [1, 8, 11, MAX_BLOCKS * 8 + 5]  # one key, one block, across a block boundary, longer than any sequence


@pytest.mark.parametrize(
    "interpret", [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
)
class TestWindowedKernelsEqualReference:
    """Block size 8 and 16-token tiles: windows start mid-page, mid-tile and on a page boundary."""

    @pytest.mark.parametrize("window", WINDOWS)
    def test_decode_kernel_with_a_window_equals_reference(self, window: int, interpret: bool):
        rng = np.random.default_rng(window)
        case = Case(8, 16, 2, "float32")
        seq_lens = [*decode_lengths(8), 8 * 3 + 3, 16]
        k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
        q = random_q(rng, case, len(seq_lens))
        seq_lens = jnp.asarray(seq_lens, jnp.int32)
        args = (q, k_pages, v_pages, seq_lens, block_tables, SM_SCALE)
        out = paged_decode_attention(*args, interpret=interpret, pages_per_tile=2, num_splits=2, sliding_window=window)
        ref = paged_decode_attention_reference(*args, sliding_window=window)
        assert_matches(out, ref, case.tolerance)
        full = paged_decode_attention_reference(*args)
        binds = window < MAX_BLOCKS * 8
        assert binds == (not np.allclose(np.asarray(ref[-3]), np.asarray(full[-3]))), "the window must bind iff shorter"

    @pytest.mark.parametrize("window", WINDOWS)
    def test_ragged_kernel_with_a_window_equals_reference(self, window: int, interpret: bool):
        rng = np.random.default_rng(window)
        case = Case(8, 16, 2, "float32")
        q_lens, seq_lens, num_tokens = mixed_batch(8)
        k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
        q = random_q(rng, case, num_tokens)
        metadata = ragged_metadata(q_lens, seq_lens, block_tables, num_tokens)
        args = (q, k_pages, v_pages, metadata, SM_SCALE)
        out = ragged_paged_attention(
            *args, interpret=interpret, block_q=8, pages_per_tile=2, sliding_window=window
        )
        ref = ragged_paged_attention_reference(*args, block_q=4, sliding_window=window)
        assert_matches(out, ref, case.tolerance)
        assert not np.asarray(out[sum(q_lens) :]).any(), "padding tokens must give 0"


def test_windowed_attention_dispatches_to_every_backend_with_the_window():
    rng = np.random.default_rng(5)
    case = Case(8, 32, 2, "float32")
    q_lens, seq_lens, num_tokens = mixed_batch(8)
    k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
    q = random_q(rng, case, num_tokens)
    metadata = ragged_metadata(q_lens, seq_lens, block_tables, num_tokens)
    windowed = ragged_paged_attention_reference(q, k_pages, v_pages, metadata, SM_SCALE, block_q=4, sliding_window=8)
    full = ragged_paged_attention_reference(q, k_pages, v_pages, metadata, SM_SCALE, block_q=4)
    assert not np.allclose(np.asarray(windowed), np.asarray(full))  # the window binds in this batch
    cpu_kernel = ("cpp",) if jax.devices()[0].platform == "cpu" else ()  # an XLA:CPU custom call
    for backend in ("xla", "pallas_interpret", *cpu_kernel):
        out = attention(q, k_pages, v_pages, metadata, SM_SCALE, AttentionPlan(backend), sliding_window=8)
        assert_matches(out, windowed, case.tolerance)

