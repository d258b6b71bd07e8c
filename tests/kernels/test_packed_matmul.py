"""The C++ matmul over packed weights (kernels_cpu/packed_matmul.cc) against numpy, and packing at load.

Sizes cover 0 and 1 rows, one short of, at and past a pass of rows (8 with AVX-512), K of 1, odd
and not a multiple of anything, and 1 to several 32-column panels, for float32 and bfloat16
weights (bfloat16: x rounded to bfloat16, products summed in float32, as XLA's bf16 dot). The
kernel is an XLA:CPU custom call: there is no `cuda` lowering to check; its builds without
AVX-512 and without the bf16 dot instruction are checked on this machine instead.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers_hf import hf_logits, make_tiny_hf_model
from test_cpu_kernel import assert_build_attends_like_reference

from cbjax.checkpoint import convert_checkpoint, load_model
from cbjax.checkpoint.weights_cache import DISABLE_ENV
from kernels_cpu import LAYOUT, pack_weight, packable, packed_matmul_cpu, packed_matmul_reference, unpack_weight
from kernels_cpu.quant import quantize_int8
from kernels_cpu.quant4 import dequantize_int4, quantize_int4
from cbjax.models.layers.attention import AttentionPlan

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the kernel is an XLA:CPU custom call")

kernel = jax.jit(packed_matmul_cpu)


def product(rng: np.random.Generator, rows: int | tuple[int, ...], k: int, n: int, dtype=np.float32):
    """x (float32), w (`dtype`) and their product in float64, x rounded to w's dtype first."""
    shape = rows if isinstance(rows, tuple) else (rows,)
    x = rng.standard_normal((*shape, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(dtype)
    return x, w, x.astype(dtype).astype(np.float64) @ w.astype(np.float64)


def assert_product(out, expected, k: int) -> None:
    out = np.asarray(out)
    assert out.shape == expected.shape and out.dtype == np.float32
    # float32 sums of k products of standard normals: errors grow like sqrt(k) * eps * |terms|
    np.testing.assert_allclose(out, expected, atol=1e-5 * max(1, k) ** 0.5 * 4, rtol=1e-5)


DTYPES = [np.float32, ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 15, 16, 17, 67, (2, 3)])
@pytest.mark.parametrize("k, n", [(1, 32), (5, 64), (32, 32), (33, 64), (64, 32), (576, 192), (1001, 96)])
def test_kernel_equals_numpy_at_edge_sizes(rows, k, n, dtype):
    x, w, expected = product(np.random.default_rng(k * 31 + n), rows, k, n, dtype)
    packed = pack_weight(w)
    assert_product(kernel(x, packed), expected, k)
    assert_product(packed_matmul_reference(x, packed), expected, k)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), k=st.integers(1, 300), panels=st.integers(1, 5), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(DTYPES))
def test_kernel_equals_numpy_on_random_sizes(rows, k, panels, seed, dtype):
    x, w, expected = product(np.random.default_rng(seed), rows, k, 32 * panels, dtype)
    assert_product(kernel(x, pack_weight(w)), expected, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_each_row_is_the_same_sum_whatever_the_batch(dtype):
    """A request's product does not depend on how many rows share its step or where it sits."""
    rng = np.random.default_rng(3)
    x, w, _ = product(rng, 19, 384, 128, dtype)
    packed = pack_weight(w)
    whole = np.asarray(kernel(x, packed))
    for row in (0, 7, 8, 18):
        np.testing.assert_array_equal(np.asarray(kernel(x[row : row + 1], packed))[0], whole[row])
        np.testing.assert_array_equal(np.asarray(kernel(x[row:], packed))[0], whole[row])


def test_packing_round_trips_and_refuses_what_it_cannot_pack():
    w = np.arange(7 * 64, dtype=np.float32).reshape(7, 64)
    packed = pack_weight(w)
    assert packed.shape == (2, 7, 32) and packed.flags.c_contiguous
    np.testing.assert_array_equal(packed[1, 3], w[3, 32:])
    np.testing.assert_array_equal(np.asarray(unpack_weight(jnp.asarray(packed))), w)
    half = w.astype(ml_dtypes.bfloat16)  # odd K: rows 2s and 2s+1 of each column side by side, a zero row last
    pairs = pack_weight(half)
    assert pairs.shape == (2, 4, 64) and pairs.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(pairs[1, 1, 4:6], half[2:4, 34])
    np.testing.assert_array_equal(pairs[0, 3, 1::2], np.zeros(32, ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(unpack_weight(jnp.asarray(pairs), 7)), half)
    assert not packable((7, 48), np.float32) and not packable((7, 64), np.float16) and not packable((64,), np.float32)
    with pytest.raises(ValueError, match=r"N a multiple of 32, got float32 \(7, 48\)"):
        pack_weight(np.zeros((7, 48), np.float32))
    with pytest.raises(ValueError, match="does not match a packed"):
        packed_matmul_cpu(jnp.zeros((2, 5)), jnp.asarray(packed))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    # 16-wide k/v (one KV head of 16): those two stay unpacked beside the packed ones.
    hf_dir = make_tiny_hf_model(tmp, "qwen2", num_key_value_heads=1, tie_word_embeddings=True)
    return hf_dir, convert_checkpoint(hf_dir, tmp / "converted")


@pytest.mark.parametrize("march", ["native -mno-amx-tile -mno-amx-bf16 -mno-amx-int8", "x86-64-v4", "x86-64-v3"])
def test_builds_without_the_bf16_dot_or_without_avx512_compute_the_same(tmp_path, monkeypatch, march):
    """The CI machine may lack what this one has: native without AMX is the bf16 dot instruction (vdpbf16ps)
    where this CPU has it, x86-64-v4 is AVX-512 without the bf16 dot instruction (bf16 pairs widened to float32),
    x86-64-v3 is AVX2 (plain loops). int8 panels (scales per column and per group, with mins too), fp8 and 4-bit ones; and
    x86-64-v3's attention, which widens f16 and bf16 pool rows without AVX-512."""
    import kernels_cpu.build as kernel_build

    flags = kernel_build.cpu_features().split()
    if "avx2" not in flags:
        pytest.skip("not an x86-64 CPU with AVX2")
    if march == "x86-64-v4" and "avx512f" not in flags:
        pytest.skip("no AVX-512 here")
    if march.startswith("native") and not {"amx_bf16", "avx512_bf16"} <= set(flags):
        pytest.skip("no AMX here: the native build is already the one without it")
    monkeypatch.setenv("CBJAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "FLAGS", tuple(
        option for f in kernel_build.FLAGS for option in (f"-march={march}".split() if f == "-march=native" else [f])))
    library = ctypes.cdll.LoadLibrary(str(kernel_build.build()))
    tag = march.split()[0].replace("-", "_") + ("_no_amx" if "-mno-amx-tile" in march else "")
    path = library.CbjaxBf16MatmulPath
    path.restype = ctypes.c_char_p
    assert path().decode() == {"native": "avx512-bf16", "x86-64-v4": "avx512", "x86-64-v3": "portable"}[march.split()[0]]
    for dtype, symbol in [(np.float32, "CbjaxPackedMatmulF32"), (ml_dtypes.bfloat16, "CbjaxPackedMatmulBF16")]:
        name = f"{symbol}_test_{tag}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        for rows, k, n in [(1, 5, 32), (9, 577, 96), (17, 64, 64)]:
            x, w, expected = product(np.random.default_rng(rows), rows, k, n, dtype)
            out = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((rows, n), jnp.float32))(x, pack_weight(w))
            assert_product(out, expected, k)
    jax.ffi.register_ffi_target(f"CbjaxPackedMatmulI8_test_{tag}", jax.ffi.pycapsule(library.CbjaxPackedMatmulI8),
                                platform="cpu")
    for rows, k, n in [(1, 5, 31), (9, 577, 96), (17, 64, 40)]:
        x, w, _ = product(np.random.default_rng(rows), rows, k, n)
        q, scales = quantize_int8(w)
        out = jax.ffi.ffi_call(f"CbjaxPackedMatmulI8_test_{tag}", jax.ShapeDtypeStruct((rows, n), jnp.float32))(
            x, pack_weight(q), scales)
        assert_product(out, x.astype(np.float64) @ (q.astype(np.float64) * scales), k)
    for rows, k, group, n in [(1, 32, 32, 31), (9, 576, 32, 96), (17, 64, 16, 40)]:  # int8 with group scales [K / G, N]
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        q = rng.integers(-127, 128, (k, n)).astype(np.int8)
        scales = rng.uniform(-0.03, 0.03, (k // group, n)).astype(np.float32)
        out = jax.ffi.ffi_call(f"CbjaxPackedMatmulI8_test_{tag}", jax.ShapeDtypeStruct((rows, n), jnp.float32))(
            x, pack_weight(q), scales)
        assert_product(out, x.astype(np.float64) @ (q * np.repeat(scales.astype(np.float64), group, 0)), k)
    jax.ffi.register_ffi_target(f"CbjaxPackedMatmulI8Mins_test_{tag}", jax.ffi.pycapsule(library.CbjaxPackedMatmulI8Mins),
                                platform="cpu")
    for rows, k, group, n in [(1, 32, 32, 31), (9, 576, 32, 96), (17, 64, 16, 40)]:  # and mins [K / G, N] (Q5_1, Q5_K)
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        q = rng.integers(0, 32, (k, n)).astype(np.int8)
        scales, mins = (rng.uniform(-0.03, 0.03, (k // group, n)).astype(np.float32) for _ in range(2))
        out = jax.ffi.ffi_call(f"CbjaxPackedMatmulI8Mins_test_{tag}", jax.ShapeDtypeStruct((rows, n), jnp.float32))(
            x, pack_weight(q), scales, mins)
        w = q * np.repeat(scales.astype(np.float64), group, 0) + np.repeat(mins.astype(np.float64), group, 0)
        np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    jax.ffi.register_ffi_target(f"CbjaxPackedMatmulF8_test_{tag}", jax.ffi.pycapsule(library.CbjaxPackedMatmulF8),
                                platform="cpu")
    for rows, k, n in [(1, 32, 31), (9, 576, 96), (17, 64, 40)]:  # fp8 codes (all finite ones) with per-column scales
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        codes = rng.integers(0, 256, (k, n)).astype(np.uint8)
        q = np.where((codes & 0x7F) == 0x7F, 0, codes).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
        scales = rng.uniform(-0.03, 0.03, n).astype(np.float32)
        out = jax.ffi.ffi_call(f"CbjaxPackedMatmulF8_test_{tag}", jax.ShapeDtypeStruct((rows, n), jnp.float32))(
            x, pack_weight(q), scales)
        np.testing.assert_allclose(out, x.astype(np.float64) @ (q.astype(np.float64) * scales), rtol=1e-4, atol=1e-4)
    jax.ffi.register_ffi_target(f"CbjaxPackedMatmulQ4_test_{tag}", jax.ffi.pycapsule(library.CbjaxPackedMatmulQ4),
                                platform="cpu")
    for rows, k, n in [(1, 64, 31), (9, 576, 96), (6, 128, 40)]:
        x, w, _ = product(np.random.default_rng(rows), rows, k, n)
        nibbles, scales, mins = quantize_int4(w, group_size=32)
        out = jax.ffi.ffi_call(f"CbjaxPackedMatmulQ4_test_{tag}", jax.ShapeDtypeStruct((rows, n), jnp.float32))(
            x, pack_weight(nibbles), scales, mins)
        np.testing.assert_allclose(out, x.astype(np.float64) @ dequantize_int4(nibbles, scales, mins), rtol=1e-4, atol=1e-4)
    jax.ffi.register_ffi_target(f"CbjaxPackedMatmulQ4Grid_test_{tag}", jax.ffi.pycapsule(library.CbjaxPackedMatmulQ4Grid),
                                platform="cpu")
    grid = np.sort(np.random.default_rng(0).uniform(-127, 127, 16)).astype(np.float32)  # nibbles index a grid (IQ4)
    for rows, k, n in [(1, 64, 31), (9, 576, 96)]:
        x, w, _ = product(np.random.default_rng(rows), rows, k, n)
        nibbles, scales, mins = quantize_int4(w, group_size=32)
        out = jax.ffi.ffi_call(f"CbjaxPackedMatmulQ4Grid_test_{tag}", jax.ShapeDtypeStruct((rows, n), jnp.float32))(
            x, pack_weight(nibbles), scales, mins, grid)
        np.testing.assert_allclose(out, x.astype(np.float64) @ dequantize_int4(nibbles, scales, mins, grid), rtol=1e-4,
                                   atol=1e-3)
    if march == "x86-64-v3":  # the other builds compile the attention's AVX-512 code, as the default one does
        assert_build_attends_like_reference(library, tag)


def forward_logits(model, token_ids: list[int], backend: str) -> np.ndarray:
    """One prompt through the model in one step (pools of one page per 16 tokens), logits at every position."""
    return np.asarray(model_logits(model, jnp.array(token_ids), backend))


def model_logits(model, token_ids: jax.Array, backend: str) -> jax.Array:
    """forward_logits as a jax function of the tokens (jit it with backend static)."""
    from kernels_pallas import AttentionMetadata
    from cbjax.models.layers.kv_pool import init_kv_pool

    n = len(token_ids)
    pages = max(2, -(-n // 16))
    caches = init_kv_pool(model.config, pages + 2, 16, jnp.float32)
    metadata = AttentionMetadata(
        slot_mapping=jnp.arange(16, 16 + n, dtype=jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32),
        seq_lens=jnp.array([n], jnp.int32), block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
    )
    logits, _ = model(token_ids, jnp.arange(n), caches, metadata, jnp.arange(n), AttentionPlan(backend))
    return logits


@pytest.mark.parametrize("backend", ["cpp", "xla"])
def test_packed_model_matches_transformers_with_the_kernel_and_with_its_jnp_fallback(checkpoint, backend):
    """backend "xla" is what the engine serves with if the C++ library fails to build after the weights were packed."""
    hf_dir, converted = checkpoint
    model, _ = load_model(converted, pack_for_cpu=True)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.kernel[...].shape == (2, 64, 32)
    assert layer.self_attn.k_proj.kernel[...].shape == (64, 16)  # not a multiple of 32: as loaded
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    np.testing.assert_allclose(forward_logits(model, tokens, backend), hf_logits(hf_dir, tokens), atol=1e-4, rtol=1e-4)


def test_bf16_weights_pack_as_bf16_panels_with_the_tied_head_and_compute_the_unpacked_model(checkpoint, tmp_path):
    """bfloat16 weights pack as bf16 panels (models/layers/linear.py PACKED_DTYPES), the tied table's transposed
    head copy too (pack_tied_head); the packed model's logits, by the kernel and by its jnp fallback, are the
    unpacked bf16 model's (XLA's bf16 dots) to float32 rounding. Packing follows the cast to the served dtype: a
    checkpoint stored in bfloat16 and served in float32 gets float32 panels."""
    hf_dir, converted = checkpoint
    half, _ = load_model(converted, dtype="bfloat16", activation_dtype="float32", pack_for_cpu=True)
    kernel = half.model.layers[0].mlp.up_proj.kernel[...]
    assert kernel.shape == (4, 32, 64) and kernel.dtype == jnp.bfloat16
    (head,) = half.tied_head
    assert head.shape == (256 // 32, 32, 64) and head.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(unpack_weight(head[...])), np.asarray(half.model.embed_tokens.embedding[...]).T)
    plain, _ = load_model(converted, dtype="bfloat16", activation_dtype="float32")
    assert len(plain.tied_head) > 1 and plain.tied_head[0].ndim == 2  # XLA's dots over column blocks
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    expected = forward_logits(plain, tokens, "cpp")
    for backend in ("cpp", "xla"):
        np.testing.assert_allclose(forward_logits(half, tokens, backend), expected, atol=2e-5, rtol=2e-5)
    stored_bf16 = convert_checkpoint(hf_dir, tmp_path / "bf16", dtype="bfloat16")
    full, _ = load_model(stored_bf16, dtype="float32", pack_for_cpu=True)
    kernel = full.model.layers[0].mlp.up_proj.kernel[...]
    assert kernel.shape == (4, 64, 32) and kernel.dtype == jnp.float32 and full.tied_head is None


def test_the_engine_packs_bf16_weights_only_on_amx_tiles(checkpoint, monkeypatch):
    """worker/build.py's choice: float32 always packs; bfloat16 packs where the kernel's path is AMX and keeps
    XLA's dots elsewhere (load_model's pack_floats=False: float projections and the tied head as they are,
    the packed layout cached under a name of its own)."""
    import cbjax.worker.build as build

    assert build.packs_float_weights("float32")
    for path, packs in [("amx", True), ("avx512-bf16", False), ("avx512", False), ("portable", False)]:
        monkeypatch.setattr(build, "bf16_matmul_path", lambda path=path: path)
        assert build.packs_float_weights("bfloat16") is packs
    _, converted = checkpoint
    model, _ = load_model(converted, dtype="bfloat16", activation_dtype="float32", pack_for_cpu=True, fused_projections=True,
                          pack_floats=False)
    assert model.model.layers[0].mlp.gate_up_proj.kernel[...].shape == (64, 256)
    assert len(model.tied_head) > 1 and model.tied_head[0].ndim == 2


def test_the_bf16_path_follows_the_cpu_flags_and_amx_can_be_turned_off(tmp_path):
    """AMX tiles where the CPU lists amx_bf16 (and Linux grants them), vdpbf16ps where it lists avx512_bf16, the
    pairs widened with AVX-512 alone; CBJAX_CPU_AMX=0 (read when the library loads) keeps the tiles off."""
    import os
    import subprocess
    import sys

    import kernels_cpu.build as kernel_build
    from kernels_cpu import bf16_matmul_path

    flags = kernel_build.cpu_features().split()
    expected = ("amx" if "amx_bf16" in flags else "avx512-bf16" if "avx512_bf16" in flags
                else "avx512" if "avx512f" in flags else "portable")
    assert bf16_matmul_path() == expected
    probe = "from kernels_cpu import bf16_matmul_path; print(bf16_matmul_path())"
    off = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "CBJAX_CPU_AMX": "0"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert off == ("avx512-bf16" if expected == "amx" else expected)


def test_weights_cache_keeps_the_packed_layout_apart(checkpoint, tmp_path, monkeypatch):
    """The packed copy is cached beside the plain one (neither evicts the other) and mapped on the next load."""
    _, converted = checkpoint
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    plain, _ = load_model(converted)
    packed, _ = load_model(converted, pack_for_cpu=True)
    files = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert len(files) == 2 and sum(f".{LAYOUT}-" in name for name in files) == 1, files

    def no_restore(*args, **kwargs):
        raise AssertionError("the second packed load must map the cached packed copy")

    monkeypatch.setattr("cbjax.checkpoint.loader._restore_orbax", no_restore)
    again, _ = load_model(converted, pack_for_cpu=True)
    for model in (packed, again):
        np.testing.assert_array_equal(
            np.asarray(unpack_weight(model.model.layers[1].mlp.down_proj.kernel[...])),
            np.asarray(plain.model.layers[1].mlp.down_proj.kernel[...]),
        )
