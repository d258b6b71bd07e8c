"""The C++ CPU attention kernel (kernels_cpu) equals the jnp reference, and its absence is survivable.

Same rules as test_kernels.py: pools are NaN except each request's tokens, so reading a slot
it should not gives NaN; lengths 0, 1, bs-1, bs, bs+1 and the maximum sit in the batches. The
kernel is CPU-only (an XLA:CPU custom call), so there is no `cuda` lowering to check.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernel_lowering import metadata as abstract_metadata
from test_kernels import MAX_BLOCKS, SM_SCALE, Case, decode_lengths, fill_pool, mixed_batch, ragged_metadata, random_q

import cbjax.models.layers.attention as backend
from kernels_cpu import build as kernel_build
from kernels_cpu import kernel_problem, ragged_paged_attention_cpu, write_kv_and_attend_cpu
from kernels_cpu.attention import scale_attributes
from kernels_cpu.registry import POOL_SUFFIXES
from kernels_pallas.reference import ragged_paged_attention_reference, write_kv

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the kernel is an XLA:CPU custom call")

CASES = [
    Case(8, 16, 1, "float32"),
    Case(16, 64, 3, "float16", num_kv_heads=3),  # SmolLM2's 9 q / 3 kv heads, float16 pool
    Case(32, 128, 4, "bfloat16"),
    Case(16, 20, 8, "float16", num_kv_heads=1),  # head_dim not a multiple of 8: the scalar tail
    Case(8, 64, 2, "float32", num_kv_heads=4),
    Case(16, 64, 3, "float32", num_kv_heads=3, kv_dtype="float8_e4m3fn", k_scale=0.05, v_scale=4.0),  # fp8 pool
    Case(8, 128, 4, "float32", num_kv_heads=2, kv_dtype="float8_e4m3fn", k_scale=2.0, v_scale=0.5),
    # A decode's rows are a group's query heads, read in blocks that share each key (4 at head_dim 64, 2 at 128):
    # 7 rows are a block of 4 and one of 3, 3 rows at 128 one of 2 and one of 1; pages of 4 keys.
    Case(16, 64, 7, "bfloat16", num_kv_heads=1),
    Case(4, 128, 3, "float16", num_kv_heads=2),
]


def jit_reference(q, k_pages, v_pages, metadata, block_q: int, sliding_window: int | None = None, **scales):
    """The jnp reference compiled whole: op by op, each new batch shape cost seconds of small compiles."""
    return jax.jit(
        functools.partial(
            ragged_paged_attention_reference, sm_scale=SM_SCALE, block_q=block_q, sliding_window=sliding_window,
            **scales,
        )
    )(q, k_pages, v_pages, metadata)


def run_both(
    case: Case, q_lens: list[int], seq_lens: list[int], num_tokens: int, seed: int, sliding_window: int | None = None,
    attention=ragged_paged_attention_cpu,
):
    """The kernel and the reference on fill_pool's NaN-filled pools, with float32 queries (CPU activations)."""
    rng = np.random.default_rng(seed)
    k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
    q = random_q(rng, case, num_tokens).astype(jnp.float32)
    metadata = ragged_metadata(q_lens, seq_lens, block_tables, num_tokens)
    kernel = functools.partial(attention, sm_scale=SM_SCALE, sliding_window=sliding_window, **case.scales)
    out = jax.jit(kernel)(q, k_pages, v_pages, metadata)
    ref = jit_reference(q, k_pages, v_pages, metadata, block_q=4, sliding_window=sliding_window, **case.scales)
    return np.asarray(out), np.asarray(ref)


def assert_close(out: np.ndarray, ref: np.ndarray) -> None:
    assert np.isfinite(out).all(), "kernel output has NaN/inf: it read a slot it should not have"
    # Both compute in float32 from the same pool values: only summation order differs.
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_batch_equals_reference(case: Case):
    seq_lens = decode_lengths(case.block_size)  # 0 (a padded row), 1, bs-1, bs, bs+1, max
    q_lens = [min(1, s) for s in seq_lens]
    out, ref = run_both(case, q_lens, seq_lens, sum(q_lens) + 2, seed=0)
    assert_close(out, ref)
    assert not out[sum(q_lens) :].any(), "padding tokens must give 0"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_mixed_batch_equals_reference(case: Case):
    q_lens, seq_lens, num_tokens = mixed_batch(case.block_size)  # chunks, cached prefixes, decodes, padding
    out, ref = run_both(case, q_lens, seq_lens, num_tokens, seed=1)
    assert_close(out, ref)
    assert not out[sum(q_lens) :].any(), "padding tokens must give 0"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_widens_every_e4m3_code_like_xla(head_dim):
    """A decode reads an fp8 pool in place, widening 16 codes at a time in registers. Requests of one key each give
    out = that key's V row exactly (its softmax weight is 1): V rows holding all 256 codes, subnormals and the two
    NaN codes included, must come out as XLA's own float8_e4m3fn -> float32 conversion gives them."""
    codes = np.arange(256, dtype=np.uint8).reshape(-1, head_dim)  # one request per row of codes
    num_reqs = codes.shape[0]
    shape = (1, num_reqs + 1, 8, head_dim)  # one KV head; request r's key in block r + 1, slot 0
    v_pages = np.zeros(shape, np.uint8)
    v_pages[0, 1:, 0] = codes
    v_pages = jnp.asarray(v_pages).view(jnp.float8_e4m3fn)
    k_pages = jnp.zeros(shape, jnp.float8_e4m3fn)
    block_tables = jnp.asarray(np.arange(1, num_reqs + 1, dtype=np.int32)[:, None])
    metadata = ragged_metadata([1] * num_reqs, [1] * num_reqs, block_tables, num_reqs)
    q = jnp.ones((num_reqs, 1, head_dim), jnp.float32)
    out = jax.jit(functools.partial(ragged_paged_attention_cpu, sm_scale=SM_SCALE))(q, k_pages, v_pages, metadata)
    expected = jnp.asarray(codes).view(jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(out)[:, 0], np.asarray(expected))  # NaN where XLA gives NaN


def assert_build_attends_like_reference(library: ctypes.CDLL, tag: str) -> None:
    """Another build of the kernels' library (test_packed_matmul's x86-64-v3 one, without AVX-512: the CI machine
    may lack what this one has): decode and mixed batches over float32, float16 and bfloat16 pools, through its
    attention targets (registered under `tag`), equal the reference."""
    for suffix in ("F32", "F16", "BF16"):
        jax.ffi.register_ffi_target(f"CbjaxPagedAttention{suffix}_test_{tag}",
                                    jax.ffi.pycapsule(getattr(library, f"CbjaxPagedAttention{suffix}")), platform="cpu")

    def attention(q, k_pages, v_pages, metadata, sm_scale, sliding_window, k_scale, v_scale):
        assert sliding_window is None
        call = jax.ffi.ffi_call(f"CbjaxPagedAttention{POOL_SUFFIXES[k_pages.dtype]}_test_{tag}",
                                jax.ShapeDtypeStruct(q.shape, jnp.float32))
        request_metadata = (metadata.query_start_loc, metadata.seq_lens, metadata.block_tables)
        return call(q, k_pages, v_pages, *request_metadata, **scale_attributes(sm_scale, k_scale, v_scale),
                    sliding_window=np.int32(0))

    for case in (Case(8, 64, 2, "float32", num_kv_heads=4), Case(16, 64, 7, "bfloat16", num_kv_heads=1),
                 Case(4, 128, 3, "float16")):
        seq_lens = decode_lengths(case.block_size)
        q_lens = [min(1, s) for s in seq_lens]
        for batch in ((q_lens, seq_lens, sum(q_lens)), mixed_batch(case.block_size)):
            assert_close(*run_both(case, *batch, seed=2, attention=attention))


# (case, window): every pool dtype and chunk path (scalar, 64- and 128-wide vectors) once, with a
# window longer than every sequence, of one block (decodes at whole-block lengths start it on a
# block boundary) and starting mid-block; a window of one token is the hand-worked test below.
WINDOWED_CASES = [
    (Case(8, 16, 1, "float32"), 1000),
    (Case(16, 64, 3, "float16", num_kv_heads=3), 16),
    (Case(32, 128, 4, "bfloat16"), 45),
]


@pytest.mark.parametrize(("case", "window"), WINDOWED_CASES, ids=lambda x: str(x))
def test_windowed_mixed_batch_equals_reference(case: Case, window: int):
    """Prompts, chunks over a cached prefix, decodes and padding, each query seeing only its window."""
    q_lens, seq_lens, num_tokens = mixed_batch(case.block_size)
    out, ref = run_both(case, q_lens, seq_lens, num_tokens, seed=6, sliding_window=window)
    assert_close(out, ref)
    assert not out[sum(q_lens) :].any(), "padding tokens must give 0"


def test_window_of_one_token_returns_each_tokens_own_value():
    """A hand-worked case: softmax over one key is 1, so each token's output is its own V row. One
    query head per KV head: items of up to 7 tokens take the narrow path, each row its own window."""
    case = Case(8, 64, 1, "float32")
    q_lens, seq_lens, num_tokens = mixed_batch(case.block_size)
    rng = np.random.default_rng(7)
    k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
    q = random_q(rng, case, num_tokens)
    metadata = ragged_metadata(q_lens, seq_lens, block_tables, num_tokens)
    out = np.asarray(ragged_paged_attention_cpu(q, k_pages, v_pages, metadata, SM_SCALE, sliding_window=1))
    token = 0
    for req, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            block = int(block_tables[req, pos // case.block_size])
            own_v = np.asarray(v_pages)[:, block, pos % case.block_size]  # [kv_heads, dim]
            np.testing.assert_array_equal(out[token], np.repeat(own_v, case.group, axis=0))
            token += 1


@pytest.mark.parametrize("window", [None, 37], ids=["full", "window37"])
def test_long_prefill_spans_several_query_tiles_and_key_chunks(window: int | None):
    # 150 new tokens over a cached prefix of 100: 10 query tiles of 16, keys in chunks of 64. With
    # a window of 37 the first token (position 100) sees from 64 on: pages 0-3 are never read.
    case = Case(16, 32, 2, "float16")
    seq_len = 250
    rng = np.random.default_rng(2)
    shape = (case.num_kv_heads, 1 + 16, case.block_size, case.head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    k[:, 1:] = rng.normal(size=(case.num_kv_heads, 16, case.block_size, case.head_dim))
    v[:, 1:] = rng.normal(size=(case.num_kv_heads, 16, case.block_size, case.head_dim))
    table = rng.permutation(np.arange(1, 17))
    k[:, table[-1], seq_len % 16 :] = np.nan  # the unused tail of the last page
    v[:, table[-1], seq_len % 16 :] = np.nan
    block_tables = jnp.asarray(table[None], jnp.int32)
    q = jnp.asarray(rng.normal(size=(160, 4, 32)), jnp.float32)
    metadata = ragged_metadata([150], [seq_len], block_tables, 160)
    k_pages, v_pages = jnp.asarray(k, jnp.float16), jnp.asarray(v, jnp.float16)
    ref = jit_reference(q, k_pages, v_pages, metadata, block_q=16, sliding_window=window)
    if window is not None:  # the reference reads (and masks) whole tiles; the kernel must skip these pages
        k_pages = k_pages.at[:, table[:4]].set(jnp.nan)
        v_pages = v_pages.at[:, table[:4]].set(jnp.nan)
    out = ragged_paged_attention_cpu(q, k_pages, v_pages, metadata, SM_SCALE, sliding_window=window)
    assert_close(np.asarray(out), np.asarray(ref))


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, MAX_BLOCKS * 8), st.integers(0, MAX_BLOCKS * 8)), min_size=1, max_size=40
    ),
    extra_tokens=st.integers(0, 5),
    window=st.one_of(st.none(), st.integers(1, MAX_BLOCKS * 8 + 2)),
    head_dim=st.sampled_from([16, 64]),  # the scalar and the vector chunk paths
)
def test_random_batches_equal_reference(
    requests: list[tuple[int, int]], extra_tokens: int, window: int | None, head_dim: int
):
    """Any mix of (q_len <= seq_len) requests, enough of them to spread over the worker threads, with
    full attention or any window."""
    case = Case(8, head_dim, 2, "float16")
    q_lens = [min(q, s) for q, s in requests]
    seq_lens = [s for _, s in requests]
    out, ref = run_both(case, q_lens, seq_lens, sum(q_lens) + extra_tokens, seed=len(requests), sliding_window=window)
    assert_close(out, ref)


@pytest.mark.parametrize(
    "dtype, scales",
    [(jnp.float32, {}), (jnp.float16, {}), (jnp.bfloat16, {}), (jnp.float8_e4m3fn, {"k_scale": 0.5, "v_scale": 3.0})],
    ids=["f32", "f16", "bf16", "fp8"],
)
def test_fused_write_equals_write_kv_then_attention(dtype, scales):
    """The call that writes the step's K/V itself leaves the pool bit-identical to write_kv's (fp8: divided by
    the scales, rounded to nearest even, saturated), and attends (with a window: the attention reads what the
    same call wrote) like the reference."""
    case = Case(8, 24, 2, "float32")
    q_lens, seq_lens, num_tokens = mixed_batch(case.block_size)
    rng = np.random.default_rng(4)
    k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
    k_pages = jnp.nan_to_num(k_pages, nan=7.0).astype(dtype)  # finite, so pools compare bitwise
    v_pages = jnp.nan_to_num(v_pages, nan=-7.0).astype(dtype)
    # Each request's newest q_len tokens are the ones written; padding tokens go to the null block.
    slots = np.zeros(num_tokens, np.int32)
    offset = 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        positions = np.arange(seq_len - q_len, seq_len)
        slots[offset : offset + q_len] = np.asarray(block_tables)[r, positions // 8] * 8 + positions % 8
        offset += q_len
    # Values that round differently in each pool dtype: tiny (half subnormals), huge (half overflow), NaN.
    scale = rng.choice([1e-6, 1e-3, 1.0, 300.0, 7e4], size=(num_tokens, case.num_kv_heads, case.head_dim))
    k = jnp.asarray(rng.normal(size=scale.shape) * scale, jnp.float32)
    v = jnp.asarray(rng.normal(size=scale.shape) * scale, jnp.float32).at[0, 0, 0].set(jnp.nan)
    q = jnp.asarray(rng.normal(size=(num_tokens, 4, case.head_dim)), jnp.float32)
    metadata = dataclasses.replace(ragged_metadata(q_lens, seq_lens, block_tables, num_tokens), slot_mapping=jnp.asarray(slots))

    window = 5
    out, k_out, v_out = jax.jit(
        functools.partial(write_kv_and_attend_cpu, sm_scale=SM_SCALE, sliding_window=window, **scales)
    )(q, k, v, k_pages, v_pages, metadata)
    k_ref, v_ref = write_kv(k_pages, v_pages, k, v, metadata.slot_mapping, **scales)
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[jnp.dtype(dtype).itemsize]
    for got, want in ((k_out, k_ref), (v_out, v_ref)):  # block 0 (the null block) holds garbage by contract
        np.testing.assert_array_equal(np.asarray(got)[:, 1:].view(bits), np.asarray(want)[:, 1:].view(bits))
    if dtype in (jnp.float32, jnp.float8_e4m3fn):  # the huge values overflow 16-bit pools; fp8 saturates
        ref = jit_reference(q, k_ref, v_ref, metadata, block_q=4, sliding_window=window, **scales)
        rows = np.arange(num_tokens) != 0  # token 0 (request 0) reads the NaN written into V
        np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(ref)[rows], rtol=2e-5, atol=2e-5)


def test_layers_cpp_attention_hands_the_window_to_the_kernel():
    """write_kv_and_attend, as a layer calls it, equals write_kv then the windowed kernel (which the
    tests above check against the reference); a window of 5 binds in this batch."""
    case = Case(8, 32, 2, "float32")
    q_lens, seq_lens, num_tokens = mixed_batch(case.block_size)
    rng = np.random.default_rng(8)
    k_pages, v_pages, block_tables = fill_pool(rng, case, seq_lens)
    q = random_q(rng, case, num_tokens)
    k, v = (jnp.asarray(rng.normal(size=(num_tokens, case.num_kv_heads, case.head_dim)), jnp.float32) for _ in "kv")
    metadata = ragged_metadata(q_lens, seq_lens, block_tables, num_tokens)  # every token writes the null block
    out, _ = backend.write_kv_and_attend(
        q, k, v, (k_pages, v_pages), metadata, SM_SCALE, backend.AttentionPlan("cpp"), sliding_window=5
    )
    written = write_kv(k_pages, v_pages, k, v, metadata.slot_mapping)
    want = ragged_paged_attention_cpu(q, *written, metadata, SM_SCALE, sliding_window=5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert not np.allclose(np.asarray(want), np.asarray(ragged_paged_attention_cpu(q, *written, metadata, SM_SCALE)))


def test_fused_write_updates_a_donated_pool_in_place():
    pool = jax.ShapeDtypeStruct((3, 512, 16, 64), jnp.float16)
    new = jax.ShapeDtypeStruct((16, 3, 64), jnp.float32)
    q = jax.ShapeDtypeStruct((16, 9, 64), jnp.float32)
    metadata = abstract_metadata(num_tokens=16, num_reqs=16, max_blocks=32)
    step = functools.partial(write_kv_and_attend_cpu, sm_scale=SM_SCALE)
    compiled = jax.jit(step, donate_argnums=(3, 4)).lower(q, new, new, pool, pool, metadata).compile()
    memory = compiled.memory_analysis()
    pool_bytes = np.prod(pool.shape) * 2
    assert memory.temp_size_in_bytes < pool_bytes // 8, "the fused write copies the pool instead of updating it"
    assert memory.alias_size_in_bytes >= 2 * pool_bytes, "the donated pools are not aliased to the outputs"


def test_pool_dtype_it_cannot_read_is_refused_with_the_fix():
    case = Case(8, 16, 1, "float32")
    k_pages, v_pages, block_tables = fill_pool(np.random.default_rng(0), case, [3])
    metadata = ragged_metadata([1], [3], block_tables, 1)
    q = jnp.zeros((1, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype="):
        ragged_paged_attention_cpu(q, k_pages.astype(jnp.int8), v_pages.astype(jnp.int8), metadata, SM_SCALE)


def test_window_of_zero_tokens_is_refused_with_the_fix():
    case = Case(8, 16, 1, "float32")
    k_pages, v_pages, block_tables = fill_pool(np.random.default_rng(0), case, [3])
    metadata = ragged_metadata([1], [3], block_tables, 1)
    with pytest.raises(ValueError, match="sliding_window=0.*pass None"):
        ragged_paged_attention_cpu(jnp.zeros((1, 1, 16)), k_pages, v_pages, metadata, SM_SCALE, sliding_window=0)


def test_build_without_a_compiler_names_it_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("CBJAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-cbjax")
    with pytest.raises(kernel_build.KernelBuildError, match="no-such-compiler-cbjax.*install one"):
        kernel_build.build()
    assert not list(tmp_path.iterdir()), "a failed build must leave nothing behind"


def test_a_broken_build_reports_the_compiler_error(tmp_path, monkeypatch):
    source = tmp_path / "broken.cc"
    source.write_text("this is not C++\n")
    monkeypatch.setenv("CBJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_build, "SOURCES", (source,))
    with pytest.raises(kernel_build.KernelBuildError, match="compiling broken.cc failed"):
        kernel_build.build()
    assert not list((tmp_path / "cache").iterdir())


def test_auto_backend_falls_back_to_xla_with_the_reason(monkeypatch):
    monkeypatch.setattr(backend, "kernel_problem", lambda wait=True: "KernelBuildError: no C++ compiler")
    with pytest.warns(RuntimeWarning, match="no C.. compiler.*jnp reference"):
        assert backend.resolve_backend.__wrapped__("auto") == "xla"
    with pytest.raises(RuntimeError, match="attention_backend='cpp'.*no C.. compiler"):
        backend.resolve_backend.__wrapped__("cpp")


def test_steps_trace_while_the_kernel_builds_and_name_that_build():
    """registration_deferred: lowering a call to the kernel does not wait for a build under way (the
    engine's start-up traces its steps meanwhile), and names the targets as the build will."""
    import threading

    from kernels_cpu import registration_deferred, registry

    build_hash = kernel_build.library_path(kernel_build.compiler()).stem.rsplit("_", 1)[-1]
    pool = jax.ShapeDtypeStruct((1, 4, 8, 16), jnp.float32)
    new = jax.ShapeDtypeStruct((2, 1, 16), jnp.float32)
    lowered = {}

    def lower() -> None:
        with registration_deferred():
            lowered["hlo"] = jax.jit(lambda *a: write_kv_and_attend_cpu(*a, sm_scale=0.25)).lower(
                new, new, new, pool, pool, abstract_metadata(num_tokens=2, num_reqs=2, max_blocks=2)
            ).as_text()

    with registry._lock:  # a build under way (register_in_background holds this lock while it builds)
        assert kernel_problem(wait=False) is None
        tracer = threading.Thread(target=lower)
        tracer.start()
        tracer.join(timeout=60)
        assert not tracer.is_alive(), "tracing under registration_deferred waited for the build"
    assert f"CbjaxWriteKvAttentionF32_{build_hash}" in lowered["hlo"]


def test_auto_backend_is_the_kernel_on_cpu():
    assert kernel_problem() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.resolve_backend.__wrapped__("auto") == "cpp"


def test_fp8_write_rounds_and_saturates_every_value_like_xla():
    """Every e4m3 value, every midpoint between neighbours (ties go to even) and a float32 step either side
    of it, subnormals, overflow and NaN: the kernel's write stores the same bytes as XLA's convert in write_kv."""
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(jnp.float8_e4m3fn).astype(np.float32)
    finite = np.sort(values[np.isfinite(values)])
    midpoints = (finite[1:] + finite[:-1]) / 2
    nudged = np.concatenate([np.nextafter(midpoints, np.inf), np.nextafter(midpoints, -np.inf)])
    new = np.concatenate([values, midpoints, nudged, [448.5, 464.0, 1e6, -1e6, np.inf, -np.inf, 1e-30]])
    dim = 16
    new = np.pad(new, (0, -len(new) % dim)).astype(np.float32).reshape(-1, 1, dim)
    num_tokens, block_size = new.shape[0], 8
    pool = jnp.zeros((1, 1 + -(-num_tokens // block_size), block_size, dim), jnp.float8_e4m3fn)
    slots = jnp.arange(block_size, block_size + num_tokens, dtype=jnp.int32)
    metadata = ragged_metadata([1], [1], jnp.ones((1, 1), jnp.int32), 1)
    metadata = dataclasses.replace(metadata, slot_mapping=slots)
    q = jnp.zeros((num_tokens, 1, dim), jnp.float32)
    _, k_out, _ = write_kv_and_attend_cpu(q, jnp.asarray(new), jnp.asarray(new), pool, pool, metadata, SM_SCALE)
    k_ref, _ = write_kv(pool, pool, jnp.asarray(new), jnp.asarray(new), slots)
    np.testing.assert_array_equal(np.asarray(k_out).view(np.uint8), np.asarray(k_ref).view(np.uint8))
