"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in flax.nnx, written for the paged engine.

Module and parameter names mirror Hugging Face's (`model.layers.3.self_attn.q_proj`), so the
checkpoint mapping is one rule per parameter kind. Linear kernels are [in, out] (HF's transposed).

One forward runs a flat ragged batch of new tokens: each layer writes its new K/V into that
layer's page pool, then attends over the pool. Nothing is mutated in __call__: the updated
pools are returned, so `nnx.merge(graphdef, state)` inside a jitted function traces cleanly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

import kernels_pallas
from cbjax.config import ModelConfig
from cbjax.models.rope import apply_rope, rope_inv_freq
from kernels_pallas.backend import attention
from kernels_pallas.reference import AttentionMetadata

KVPages = Float[Array, "kv_heads blocks block_size dim"]
KVCache = tuple[KVPages, KVPages]


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalize in float32, cast back, then scale (so bf16 rounds where HF does)."""

    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... size"]) -> Float[Array, "... size"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def _linear(in_features: int, out_features: int, use_bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden, head_dim = config.hidden_size, config.head_dim
        self.config = config
        self.q_proj = _linear(hidden, config.num_attention_heads * head_dim, config.attention_bias, dtype, rngs)
        self.k_proj = _linear(hidden, config.num_key_value_heads * head_dim, config.attention_bias, dtype, rngs)
        self.v_proj = _linear(hidden, config.num_key_value_heads * head_dim, config.attention_bias, dtype, rngs)
        self.o_proj = _linear(config.num_attention_heads * head_dim, hidden, config.attention_out_bias, dtype, rngs)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype)

    def __call__(
        self,
        x: Float[Array, "tokens hidden"],
        positions: Int[Array, "tokens"],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        *,
        attention_backend: str,
        decode_only: bool,
    ) -> tuple[Float[Array, "tokens hidden"], KVCache]:
        config = self.config
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, config.num_attention_heads, config.head_dim)
        k = self.k_proj(x).reshape(num_tokens, config.num_key_value_heads, config.head_dim)
        v = self.v_proj(x).reshape(num_tokens, config.num_key_value_heads, config.head_dim)
        if config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(config)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        k_pages, v_pages = kernels_pallas.write_kv(*kv_cache, k, v, metadata.slot_mapping)
        out = attention(
            q, k_pages, v_pages, metadata, config.head_dim**-0.5, backend=attention_backend, decode_only=decode_only
        )
        return self.o_proj(out.reshape(num_tokens, -1)), (k_pages, v_pages)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(hidden, inner, config.mlp_bias, dtype, rngs)
        self.up_proj = _linear(hidden, inner, config.mlp_bias, dtype, rngs)
        self.down_proj = _linear(inner, hidden, config.mlp_bias, dtype, rngs)

    def __call__(self, x: Float[Array, "tokens hidden"]) -> Float[Array, "tokens hidden"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        x: Float[Array, "tokens hidden"],
        positions: Int[Array, "tokens"],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        *,
        attention_backend: str,
        decode_only: bool,
    ) -> tuple[Float[Array, "tokens hidden"], KVCache]:
        attn_out, kv_cache = self.self_attn(
            self.input_layernorm(x), positions, kv_cache, metadata,
            attention_backend=attention_backend, decode_only=decode_only,
        )
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaModel(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.model = LlamaModel(config, dtype=dtype, rngs=rngs)
        # Tied models reuse the embedding matrix as the LM head, so there is no lm_head parameter.
        self.lm_head = None if config.tie_word_embeddings else _linear(
            config.hidden_size, config.vocab_size, False, dtype, rngs
        )

    def __call__(
        self,
        token_ids: Int[Array, "tokens"],
        positions: Int[Array, "tokens"],
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        logits_indices: Int[Array, "samples"],
        *,
        attention_backend: str = "xla",
        decode_only: bool = False,
    ) -> tuple[Float[Array, "samples vocab"], list[KVCache]]:
        """Logits (float32) at rows `logits_indices` of the batch, and every layer's updated pool."""
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"got {len(kv_caches)} KV caches for {self.config.num_hidden_layers} layers; "
                f"build them with init_kv_caches(config, ...)"
            )
        x = self.model.embed_tokens(token_ids)
        new_caches = []
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, kv_cache = layer(
                x, positions, kv_cache, metadata, attention_backend=attention_backend, decode_only=decode_only
            )
            new_caches.append(kv_cache)
        # Gather before the norm and head: only the sampled rows ever pay for the vocab projection.
        x = self.model.norm(x[logits_indices])
        logits = self.model.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32), new_caches


def init_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> list[KVCache]:
    """Zeroed page pools, one (k_pages, v_pages) pair per layer: [kv_heads, num_blocks, block_size, head_dim]."""
    shape = (config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_hidden_layers)]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes one block id costs across all layers (K and V): what pool sizing divides memory by."""
    per_layer = 2 * config.num_key_value_heads * block_size * config.head_dim * jnp.dtype(dtype).itemsize
    return per_layer * config.num_hidden_layers
