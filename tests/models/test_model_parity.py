"""The cbjax model equals transformers' logits at every position, with KV going through a scattered paged pool.

Every case: a tiny random HF model -> save_pretrained (safetensors) -> convert_checkpoint -> load_model.
Pools start full of NaN and requests own scattered, non-contiguous blocks, so any read of a slot that
was not written this run (null block, unused blocks, the tail of a page) would poison the logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbjax.checkpoint import convert_checkpoint, load_model
from cbjax.models.layers.kv_pool import init_kv_pool
from helpers_hf import hf_logits, make_tiny_hf_model
from kernels_pallas import AttentionMetadata
from cbjax.models.layers.attention import AttentionPlan

BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_BLOCKS = 6  # per request: up to 24 tokens
NUM_TOKENS = 32  # token bucket of the mixed step
NUM_REQS = 4  # request bucket of both steps
ATOL = RTOL = 1e-4

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=32)
CASES = {
    "llama_gqa2_untied": ("llama", {}),
    "llama_mha_tied_linear_rope": (
        "llama", dict(num_key_value_heads=4, tie_word_embeddings=True,
                      rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0))),
    "llama3_rope_with_biases": ("llama", dict(rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True)),
    "mistral_gqa4": ("mistral", dict(num_key_value_heads=1)),
    "qwen2_qkv_bias_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3_qk_norm_head_dim32": ("qwen3", {}),
    # q/k norms over the whole projection, post-attention and post-MLP norms; biases on q/k/v and o.
    "olmo2_whole_qk_norm_with_biases": ("olmo2", dict(attention_bias=True)),
    # Local layers (window 5, shorter than the prompts) and global ones with their own RoPE bases, Gemma's
    # norms, scaled embeddings, GELU-tanh MLP, capped logits (helpers_hf's defaults); 16-wide heads.
    "gemma3_local_global_head_dim16": ("gemma3_text", dict(head_dim=16)),
}


@dataclasses.dataclass
class Loaded:
    hf_dir: object
    config: object
    mixed_step: object  # (kv_pool, token_ids, positions, metadata, logits_indices) -> (logits, kv_pool)
    decode_step: object


# "packed": the projections packed for the CPU matmul kernel at load and run by it (with the C++
# attention); widths that are not a multiple of 32 stay unpacked (mistral_gqa4's 16-wide k/v).
# "fused+packed": q/k/v and gate/up fused into one kernel each first, then packed, as the engine
# serves on a CPU (a GPU serves them fused, unpacked).
LAYOUTS = ("plain", "packed", "fused+packed")
# Fused on the cases whose fused kernels differ most: biases on q/k/v and the MLP, a 16-wide k/v
# (its fused kernel packs though k and v alone would not), q/k/v biases with a tied head, and q/k
# norms that must apply after the fused columns are split.
FUSED_CASES = ("llama3_rope_with_biases", "mistral_gqa4", "qwen2_qkv_bias_tied", "olmo2_whole_qk_norm_with_biases")


@pytest.fixture(scope="module", ids="-".join, params=[
    (case, layout) for case in CASES for layout in LAYOUTS
    if not layout.startswith("fused") or case in FUSED_CASES])
def loaded(request, tmp_path_factory) -> Loaded:
    case, layout = request.param
    is_packed, fused = layout.endswith("packed"), layout.startswith("fused")
    if is_packed and jax.devices()[0].platform != "cpu":
        pytest.skip("the packed projections are a CPU kernel")
    arch, overrides = CASES[case]
    tmp = tmp_path_factory.mktemp(case)
    hf_dir = make_tiny_hf_model(tmp, arch, **overrides)
    model, config = load_model(convert_checkpoint(hf_dir, tmp / "converted"), pack_for_cpu=is_packed,
                               fused_projections=fused)
    graphdef, state = nnx.split(model)
    packed = [leaf for leaf in jax.tree_util.tree_leaves(state) if leaf.ndim == 3]
    assert bool(packed) == is_packed
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj") == fused
    backend = "cpp" if is_packed else "xla"

    def step(decode_only, kv_pool, token_ids, positions, metadata, logits_indices):
        return nnx.merge(graphdef, state)(
            token_ids, positions, kv_pool, metadata, logits_indices, AttentionPlan(backend, decode_only=decode_only)
        )

    return Loaded(
        hf_dir, config,
        jax.jit(lambda *args: step(False, *args)),
        jax.jit(lambda *args: step(True, *args)),
    )


@dataclasses.dataclass
class Seq:
    """One request: its whole token sequence so far and the (scattered) blocks it owns."""

    token_ids: list[int]
    blocks: list[int]


def pack(chunks: list[tuple[Seq, int]], num_tokens: int):
    """Ragged batch of the last `q_len` tokens of each seq, padded to num_tokens tokens and NUM_REQS rows."""
    token_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
    block_tables = np.zeros((NUM_REQS, MAX_BLOCKS), np.int32)
    for row, (seq, q_len) in enumerate(chunks):
        for pos in range(len(seq.token_ids) - q_len, len(seq.token_ids)):
            token_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_start_loc.append(len(token_ids))
        seq_lens.append(len(seq.token_ids))
        block_tables[row, : len(seq.blocks)] = seq.blocks
    real = len(token_ids)
    pad_tokens, pad_reqs = num_tokens - real, NUM_REQS - len(chunks)
    metadata = AttentionMetadata(
        slot_mapping=jnp.array(slots + [i % BLOCK_SIZE for i in range(pad_tokens)], jnp.int32),  # null block 0
        query_start_loc=jnp.array(query_start_loc + [real] * pad_reqs, jnp.int32),
        seq_lens=jnp.array(seq_lens + [0] * pad_reqs, jnp.int32),
        block_tables=jnp.asarray(block_tables),
    )
    token_ids = jnp.array(token_ids + [0] * pad_tokens, jnp.int32)
    positions = jnp.array(positions + [0] * pad_tokens, jnp.int32)
    return token_ids, positions, metadata, query_start_loc


def nan_pools(config):
    return tuple(jnp.full_like(pages, jnp.nan) for pages in init_kv_pool(config, NUM_BLOCKS, BLOCK_SIZE, jnp.float32))


def random_tokens(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    return rng.integers(0, vocab_size, n).tolist()


def prefill(loaded: Loaded, seqs: list[Seq], kv_pool):
    """One mixed step over the whole of each seq; returns each seq's logits at every position."""
    token_ids, positions, metadata, starts = pack([(seq, len(seq.token_ids)) for seq in seqs], NUM_TOKENS)
    logits, kv_pool = loaded.mixed_step(kv_pool, token_ids, positions, metadata, jnp.arange(NUM_TOKENS))
    assert np.isfinite(np.asarray(logits[: starts[-1]])).all()
    return [np.asarray(logits[starts[i]: starts[i + 1]]) for i in range(len(seqs))], kv_pool


def test_single_prompt_logits_match_hf_at_every_position(loaded):
    rng = np.random.default_rng(0)
    seq = Seq(random_tokens(rng, loaded.config.vocab_size, 13), blocks=[7, 3, 9, 12])
    (logits,), _ = prefill(loaded, [seq], nan_pools(loaded.config))
    np.testing.assert_allclose(logits, hf_logits(loaded.hf_dir, seq.token_ids), atol=ATOL, rtol=RTOL)


def test_ragged_batch_of_three_prompts_matches_hf(loaded):
    rng = np.random.default_rng(1)
    seqs = [
        Seq(random_tokens(rng, loaded.config.vocab_size, 1), blocks=[5]),
        Seq(random_tokens(rng, loaded.config.vocab_size, 11), blocks=[14, 2, 20]),
        Seq(random_tokens(rng, loaded.config.vocab_size, 6), blocks=[11, 8]),
    ]
    all_logits, _ = prefill(loaded, seqs, nan_pools(loaded.config))
    for seq, logits in zip(seqs, all_logits):
        np.testing.assert_allclose(logits, hf_logits(loaded.hf_dir, seq.token_ids), atol=ATOL, rtol=RTOL)


def test_decode_steps_after_prefill_read_kv_back_from_pool(loaded):
    rng = np.random.default_rng(2)
    vocab = loaded.config.vocab_size
    seqs = [Seq(random_tokens(rng, vocab, 6), blocks=[9, 4, 17]), Seq(random_tokens(rng, vocab, 3), blocks=[21, 6])]
    continuations = [random_tokens(rng, vocab, 5) for _ in seqs]
    _, kv_pool = prefill(loaded, seqs, nan_pools(loaded.config))
    decoded = [[] for _ in seqs]
    for step in range(5):
        for seq, continuation in zip(seqs, continuations):
            seq.token_ids.append(continuation[step])
        token_ids, positions, metadata, _ = pack([(seq, 1) for seq in seqs], NUM_REQS)
        logits, kv_pool = loaded.decode_step(kv_pool, token_ids, positions, metadata, jnp.arange(len(seqs)))
        for i in range(len(seqs)):
            decoded[i].append(np.asarray(logits[i]))
    for seq, logits in zip(seqs, decoded):
        expected = hf_logits(loaded.hf_dir, seq.token_ids)[-5:]
        np.testing.assert_allclose(np.stack(logits), expected, atol=ATOL, rtol=RTOL)
