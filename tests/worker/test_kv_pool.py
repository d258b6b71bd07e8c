"""The KV pool: one (K, V) pair for all layers, layer l's copy of block b at page l * num_blocks + b.

A step passes two pool arrays instead of two per layer (JAX's call pays per array); these tests
check what that layout must still give: each layer writes only its own pages, and a whole forward
over every layer updates the donated pool in place, with the C++ kernel and the jnp path alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbjax.checkpoint.params import abstract_model
from cbjax.models.config import ModelConfig, RopeScaling
from cbjax.models.layers.kv_pool import init_kv_pool
from cbjax.models.llama import LlamaForCausalLM
from kernels_pallas import AttentionMetadata
from cbjax.models.layers.attention import AttentionPlan
from cbjax.worker.model_runner import kv_cache_dtype

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 3, 6, 4, 3
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=RopeScaling(), max_position_embeddings=64, tie_word_embeddings=True,
    attention_bias=False, attention_out_bias=False, mlp_bias=False, qk_norm=False, dtype="float32",
    bos_token_id=None, eos_token_id=(0,),
)
BACKENDS = ["xla", pytest.param("cpp", marks=pytest.mark.skipif(
    jax.devices()[0].platform != "cpu", reason="the C++ kernel is an XLA:CPU custom call"))]


def prompt_metadata(num_tokens: int, blocks: list[int]) -> AttentionMetadata:
    """One request computing its first `num_tokens` tokens into `blocks` (block ids 1..NUM_BLOCKS-1)."""
    slots = [blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(num_tokens)]
    return AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        query_start_loc=jnp.asarray([0, num_tokens], jnp.int32),
        seq_lens=jnp.asarray([num_tokens], jnp.int32),
        block_tables=jnp.asarray([blocks + [0] * (MAX_BLOCKS - len(blocks))], jnp.int32),
    )


def test_in_layer_moves_slots_and_block_ids_by_whole_layers():
    metadata = prompt_metadata(6, [4, 1])  # slots 16..19 in block 4, then 4..5 in block 1
    moved = metadata.in_layer(2 * NUM_BLOCKS, BLOCK_SIZE)  # layer 2's blocks start at page 12
    np.testing.assert_array_equal(moved.slot_mapping, [64, 65, 66, 67, 52, 53])  # (12 + 4) * 4 + i, (12 + 1) * 4 + i
    np.testing.assert_array_equal(moved.block_tables, [[16, 13, 12]])  # the padding entry is layer 2's null block
    np.testing.assert_array_equal(moved.seq_lens, metadata.seq_lens)
    assert metadata.in_layer(0, BLOCK_SIZE) is metadata


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_layer_writes_only_its_own_pages(backend):
    model = LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    blocks, num_tokens = [4, 1], 6
    pool = tuple(jnp.full_like(pages, jnp.nan) for pages in init_kv_pool(CONFIG, NUM_BLOCKS, BLOCK_SIZE, jnp.float32))
    token_ids = jnp.arange(3, 3 + num_tokens, dtype=jnp.int32)
    _, (k_pages, v_pages) = model.hidden_states(
        token_ids, jnp.arange(num_tokens, dtype=jnp.int32), pool, prompt_metadata(num_tokens, blocks), AttentionPlan(backend)
    )
    for pages in (np.asarray(k_pages), np.asarray(v_pages)):
        assert pages.shape == (CONFIG.num_key_value_heads, NUM_LAYERS * NUM_BLOCKS, BLOCK_SIZE, CONFIG.head_dim)
        written = ~np.isnan(pages).all(axis=(0, 3))  # [pages, offsets]: which token rows got a value
        want = np.zeros_like(written)
        for layer in range(NUM_LAYERS):
            for i in range(num_tokens):
                want[layer * NUM_BLOCKS + blocks[i // BLOCK_SIZE], i % BLOCK_SIZE] = True
        np.testing.assert_array_equal(written, want)
        per_layer = [pages[:, layer * NUM_BLOCKS + blocks[0]] for layer in range(NUM_LAYERS)]
        assert not any(np.array_equal(per_layer[0], other) for other in per_layer[1:]), "layers wrote the same K/V"


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.float8_e4m3fn], ids=["f32", "fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_over_every_layer_updates_the_donated_pool_in_place(backend, pool_dtype):
    if backend == "xla" and pool_dtype == jnp.float8_e4m3fn and jax.devices()[0].platform == "cpu":
        pytest.skip("XLA:CPU widens an fp8 scatter's pool to f16 (a copy per layer); CPUs serve fp8 with the C++ kernel")
    graphdef, state = nnx.split(abstract_model(CONFIG, jnp.float32, jnp.float32))
    num_blocks, num_tokens = 256, 16  # a pool much larger than the step's other buffers
    pool = jax.eval_shape(lambda: init_kv_pool(CONFIG, num_blocks, 16, pool_dtype))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    metadata = AttentionMetadata(i32(num_tokens), i32(num_tokens + 1), i32(num_tokens), i32(num_tokens, 8))

    def forward(state, pool, token_ids, positions, metadata):
        model = nnx.merge(graphdef, state)
        return model.hidden_states(token_ids, positions, pool, metadata, AttentionPlan(backend, decode_only=True))

    compiled = jax.jit(forward, donate_argnums=1).lower(state, pool, i32(num_tokens), i32(num_tokens), metadata).compile()
    memory = compiled.memory_analysis()
    pool_bytes = sum(pages.size * pages.dtype.itemsize for pages in pool)
    assert memory.temp_size_in_bytes < pool_bytes // 8, "a layer's write copies the pool instead of updating it"
    assert memory.alias_size_in_bytes >= pool_bytes, "the donated pool is not aliased to the output"


def test_vllms_fp8_names_give_an_e4m3_pool():
    assert kv_cache_dtype("fp8", model=None) == kv_cache_dtype("fp8_e4m3", model=None) == jnp.float8_e4m3fn
    assert kv_cache_dtype("float16", model=None) == jnp.float16
