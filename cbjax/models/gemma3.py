"""Gemma 3, text only (`Gemma3ForCausalLM`): Llama's paged layers, arranged as transformers' modeling_gemma3.py does.

What differs from Llama, and where it is decided:
  - local (sliding-window) and global layers, each with its own RoPE base: ModelConfig.sliding_windows and
    ModelConfig.rope(layer), read by the shared Attention;
  - scores scaled by query_pre_attn_scalar ** -0.5 (ModelConfig.sm_scale); a GELU-tanh MLP (hidden_act);
  - Gemma's RMSNorm, scale 1 + weight in float32 (GemmaRMSNorm), for q/k (per head), the final norm, and four
    norms per layer: before and after attention, before and after the MLP;
  - embeddings scaled by sqrt(hidden_size), rounded to the weights' dtype first as transformers does;
  - final_logit_softcapping on the logits where the config sets it.
Attention logit soft-capping (Gemma 2) is refused when the config is read: no attention path caps scores.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cbjax.models.config import ModelConfig
from cbjax.models.layers.attention import AttentionPlan
from cbjax.models.layers.embedding import embedding_rows
from cbjax.models.layers.kv_pool import KVPool
from cbjax.models.layers.norm import GemmaRMSNorm
from cbjax.models.llama import MLP, Attention, LlamaForCausalLM
from kernels_pallas.reference import AttentionMetadata


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's per-head q/k norms."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False, layer_index: int = 0):
        super().__init__(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused,
                         layer_index=layer_index)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)


class Gemma3DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False, layer_index: int = 0):
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused,
                                         layer_index=layer_index)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused)

    def __call__(
        self,
        x: Float[Array, "tokens hidden"],
        positions: Int[Array, "tokens"],
        kv_pool: KVPool,
        metadata: AttentionMetadata,
        plan: AttentionPlan,
    ) -> tuple[Float[Array, "tokens hidden"], KVPool]:
        """`metadata` names this layer's blocks of the pool (AttentionMetadata.in_layer)."""
        attn_out, kv_pool = self.self_attn(self.input_layernorm(x), positions, kv_pool, metadata, plan)
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x), plan)
        return x + self.post_feedforward_layernorm(mlp_out), kv_pool


class Gemma3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with Gemma 3's decoder layer, final norm, scaled embeddings and capped logits."""

    decoder_layer = Gemma3DecoderLayer
    final_norm = GemmaRMSNorm

    def embed(self, token_ids: Int[Array, "tokens"]) -> Float[Array, "tokens hidden"]:
        rows = embedding_rows(self.model.embed_tokens, token_ids)
        # The normaliser in the table's dtype, as transformers rounds it (sqrt(3072) is 55.5 in bfloat16).
        normalizer = jnp.asarray(self.config.hidden_size**0.5, jnp.float32).astype(rows.dtype)
        return (rows * normalizer).astype(self.activation_dtype)

    def compute_logits(self, hidden: Float[Array, "rows hidden"], plan: AttentionPlan = AttentionPlan()) -> Float[Array, "rows vocab"]:
        logits = super().compute_logits(hidden, plan)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
