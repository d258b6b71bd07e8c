"""16-bit weights under float32 activations (the CPU `dtype="bfloat16"` mode) against transformers in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, make_tiny_hf_model

from cbjax.checkpoint import convert_checkpoint, load_model
from cbjax.models.layers.kv_pool import init_kv_pool
from kernels_pallas import AttentionMetadata

BLOCK_SIZE, NUM_BLOCKS = 4, 8


def prompt_logits(model, config, token_ids: list[int], kv_dtype=None) -> np.ndarray:
    """Logits at every position of one prompt, prefilled through the paged pool on blocks 1..."""
    n = len(token_ids)
    blocks = np.arange(1, -(-n // BLOCK_SIZE) + 1, dtype=np.int32)
    positions = np.arange(n, dtype=np.int32)
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE),
        query_start_loc=jnp.array([0, n], jnp.int32),
        seq_lens=jnp.array([n], jnp.int32),
        block_tables=jnp.asarray(np.pad(blocks, (0, NUM_BLOCKS - 1 - len(blocks)))[None]),
    )
    kv = init_kv_pool(config, NUM_BLOCKS, BLOCK_SIZE, kv_dtype or model.activation_dtype)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, kv: nnx.merge(graphdef, s)(jnp.asarray(token_ids), jnp.asarray(positions), kv, metadata, jnp.arange(n)))
    logits, _ = step(state, kv)
    return np.asarray(logits)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_weights_with_f32_activations_track_transformers_f32(tmp_path, tied):
    hf_dir = make_tiny_hf_model(tmp_path, "llama", tie_word_embeddings=tied)
    ckpt = convert_checkpoint(hf_dir, tmp_path / "ckpt")
    token_ids = np.random.default_rng(0).integers(0, 256, 20).tolist()
    expected = hf_logits(hf_dir, token_ids)

    mixed, config = load_model(ckpt, dtype="bfloat16", activation_dtype="float32")
    assert mixed.activation_dtype == jnp.float32
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(nnx.state(mixed, nnx.Param)))
    if tied:  # the transposed head copy is the embedding, exactly
        head = np.concatenate([np.asarray(part[...]) for part in mixed.tied_head], axis=1)
        np.testing.assert_array_equal(head, np.asarray(mixed.model.embed_tokens.embedding[...]).T)
    logits = prompt_logits(mixed, config, token_ids)
    assert logits.dtype == np.float32
    # bf16 keeps about 3 significant digits: the logits move by a percent or so, no more.
    relative = np.linalg.norm(logits - expected) / np.linalg.norm(expected)
    assert relative < 2e-2
    # The same path in float32 is exact to rounding, so the tolerance above is bf16's alone.
    full, _ = load_model(ckpt, dtype="float32")
    assert np.linalg.norm(prompt_logits(full, config, token_ids) - expected) / np.linalg.norm(expected) < 1e-5


def test_float16_kv_pool_tracks_transformers_f32(tmp_path):
    """kv_cache_dtype="float16": K/V rounded to 10-bit mantissas on the way into the pool, math in f32."""
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2")
    token_ids = np.random.default_rng(1).integers(0, 256, 20).tolist()
    expected = hf_logits(hf_dir, token_ids)
    model, config = load_model(convert_checkpoint(hf_dir, tmp_path / "ckpt"), dtype="float32")
    relative = lambda logits: np.linalg.norm(logits - expected) / np.linalg.norm(expected)  # noqa: E731
    assert 1e-6 < relative(prompt_logits(model, config, token_ids, jnp.float16)) < 2e-3
