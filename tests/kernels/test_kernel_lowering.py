"""Both kernels lower through Pallas-to-Triton for CUDA on a CPU-only machine, and the
wrappers refuse, with the reason and the fix, the shapes Triton cannot take.

Lowering runs the Triton lowering rules (power-of-two blocks, supported ops);
it does not check Triton's minimum dot size of 16, which is why the wrappers do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.lowering import lowering_target
from kernels_pallas.paged_attention import paged_decode_attention
from kernels_pallas.ragged_attention import ragged_paged_attention
from kernels_pallas.reference import AttentionMetadata

SDS = jax.ShapeDtypeStruct


def lower_for_cuda(fn, *args) -> str:
    with lowering_target("cuda"):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def pool(num_kv_heads: int, head_dim: int, block_size: int, dtype, num_blocks: int = 64) -> SDS:
    return SDS((num_kv_heads, num_blocks, block_size, head_dim), dtype)


def metadata(num_tokens: int, num_reqs: int, max_blocks: int) -> AttentionMetadata:
    i32 = jnp.int32
    return AttentionMetadata(
        SDS((num_tokens,), i32), SDS((num_reqs + 1,), i32), SDS((num_reqs,), i32), SDS((num_reqs, max_blocks), i32)
    )


def with_block_tables(md: AttentionMetadata, shape: tuple[int, int]) -> AttentionMetadata:
    return dataclasses.replace(md, block_tables=SDS(shape, jnp.int32))


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype, num_reqs, max_blocks, kernel keywords)
DECODE_SHAPES = {
    "llama3-8b": (32, 8, 128, 16, jnp.bfloat16, 64, 512, {}),
    "llama3-8b-one-long-seq": (32, 8, 128, 16, jnp.bfloat16, 1, 512, {}),  # many splits
    "smollm2": (9, 3, 64, 16, jnp.bfloat16, 16, 128, {"num_splits": 1}),
    "mha-f32-bs8": (4, 4, 16, 8, jnp.float32, 8, 9, {"num_splits": 3}),
    "f16-bs32": (16, 2, 32, 32, jnp.float16, 4, 7, {"pages_per_tile": 1}),
    "mistral-window4096": (32, 8, 128, 16, jnp.bfloat16, 64, 2048, {"sliding_window": 4096}),
    "window1-bs8": (4, 4, 16, 8, jnp.float32, 8, 9, {"sliding_window": 1, "num_splits": 2}),
}
RAGGED_SHAPES = {
    "llama3-8b": (32, 8, 128, 16, jnp.bfloat16, 512, 32, 512, {}),
    "smollm2": (9, 3, 64, 16, jnp.bfloat16, 256, 16, 128, {}),
    "mha-f32-bs8": (4, 4, 16, 8, jnp.float32, 64, 8, 9, {"block_q": 16}),
    "f16-bs32": (16, 2, 32, 32, jnp.float16, 128, 4, 7, {"block_q": 2, "pages_per_tile": 1}),
    "gemma3-1b-window512": (4, 1, 256, 16, jnp.bfloat16, 512, 32, 2048, {"sliding_window": 512}),
}


@pytest.mark.parametrize("shape", DECODE_SHAPES.values(), ids=DECODE_SHAPES.keys())
def test_decode_kernel_lowers_for_cuda(shape):
    num_q_heads, num_kv_heads, head_dim, block_size, dtype, num_reqs, max_blocks, tiles = shape
    k_pages = pool(num_kv_heads, head_dim, block_size, dtype)
    text = lower_for_cuda(
        lambda q, k, v, lens, tables: paged_decode_attention(q, k, v, lens, tables, 0.1, **tiles),
        SDS((num_reqs, num_q_heads, head_dim), dtype),
        k_pages,
        k_pages,
        SDS((num_reqs,), jnp.int32),
        SDS((num_reqs, max_blocks), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("shape", RAGGED_SHAPES.values(), ids=RAGGED_SHAPES.keys())
def test_ragged_kernel_lowers_for_cuda(shape):
    num_q_heads, num_kv_heads, head_dim, block_size, dtype, num_tokens, num_reqs, max_blocks, tiles = shape
    k_pages = pool(num_kv_heads, head_dim, block_size, dtype)
    text = lower_for_cuda(
        lambda q, k, v, md: ragged_paged_attention(q, k, v, md, 0.1, **tiles),
        SDS((num_tokens, num_q_heads, head_dim), dtype),
        k_pages,
        k_pages,
        metadata(num_tokens, num_reqs, max_blocks),
    )
    assert "__gpu$xla.gpu.triton" in text


def test_kernels_lower_for_cuda_over_an_fp8_pool():
    """SmolLM2's shapes under bf16 activations, reading an e4m3 pool with its scales (kv_cache_dtype="fp8")."""
    k_pages = pool(3, 64, 16, jnp.float8_e4m3fn)
    scales = {"k_scale": 0.05, "v_scale": 4.0}
    decode = lower_for_cuda(
        lambda q, k, v, lens, tables: paged_decode_attention(q, k, v, lens, tables, 0.1, **scales),
        SDS((16, 9, 64), jnp.bfloat16), k_pages, k_pages, SDS((16,), jnp.int32), SDS((16, 128), jnp.int32),
    )
    ragged = lower_for_cuda(
        lambda q, k, v, md: ragged_paged_attention(q, k, v, md, 0.1, **scales),
        SDS((256, 9, 64), jnp.bfloat16), k_pages, k_pages, metadata(256, 16, 128),
    )
    for text in (decode, ragged):
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize(
    "head_dim, block_size, tiles, message",
    [
        (80, 16, {}, "head_dim=80 must be a power of two"),
        (64, 12, {}, "block_size=12 must be a power of two"),
        (64, 8, {"pages_per_tile": 1}, "gives tiles of 8 tokens"),
        (64, 16, {"pages_per_tile": 3}, "pages_per_tile=3"),
        (64, 16, {"num_splits": 0}, "num_splits=0"),
    ],
)
def test_decode_wrapper_explains_unsupported_shapes(head_dim, block_size, tiles, message):
    k_pages = pool(2, head_dim, block_size, jnp.bfloat16)
    args = SDS((4, 8, head_dim), jnp.bfloat16), k_pages, k_pages, SDS((4,), jnp.int32), SDS((4, 5), jnp.int32)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda q, k, v, lens, tables: paged_decode_attention(q, k, v, lens, tables, 0.1, **tiles), *args)


@pytest.mark.parametrize(
    "num_q_heads, tiles, md, message",
    [
        (6, {}, metadata(32, 4, 5), "num_q_heads=6 is not a multiple of num_kv_heads=4"),
        (4, {"block_q": 8}, metadata(32, 4, 5), "gives 8 score rows"),
        (4, {}, with_block_tables(metadata(32, 3, 5), (4, 5)), "query_start_loc must be \\(5,\\)"),
    ],
)
def test_ragged_wrapper_explains_unsupported_shapes(num_q_heads, tiles, md, message):
    k_pages = pool(4, 32, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(
            lambda q, k, v, m: ragged_paged_attention(q, k, v, m, 0.1, **tiles),
            SDS((32, num_q_heads, 32), jnp.bfloat16), k_pages, k_pages, md,
        )
