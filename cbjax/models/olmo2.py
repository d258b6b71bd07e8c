"""OLMo-2 (`Olmo2ForCausalLM`): Llama's layers, rearranged as transformers' modeling_olmo2.py does.

Two differences from Llama, both in the decoder layer:
  - q and k are RMS-normalized over the whole projection (every head at once, before RoPE), not per
    head as Qwen3 does; the scales are [heads * head_dim] and [kv_heads * head_dim] wide.
  - no norm before attention or the MLP: the residual gets post_attention_layernorm(attn(x)) and
    post_feedforward_layernorm(mlp(x)).
OLMo-2's RMSNorm scales in float32 before casting back (Llama's casts, then scales). Fused q/k/v
works unchanged: the norms apply after the fused kernel's columns are split.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cbjax.models.config import ModelConfig
from cbjax.models.layers.attention import AttentionPlan
from cbjax.models.layers.kv_pool import KVPool
from cbjax.models.layers.norm import RMSNorm
from cbjax.models.llama import Attention, LlamaForCausalLM, feed_forward
from kernels_pallas.reference import AttentionMetadata


class Olmo2RMSNorm(RMSNorm):
    """HF's Olmo2RMSNorm: normalize and scale in float32, then cast back."""

    def __call__(self, x: Float[Array, "... size"]) -> Float[Array, "... size"]:
        return (self.weight[...].astype(jnp.float32) * self.normalized(x)).astype(x.dtype)


class Olmo2Attention(Attention):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False):
        super().__init__(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused)
        self.q_norm = Olmo2RMSNorm(config.num_attention_heads * config.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = Olmo2RMSNorm(config.num_key_value_heads * config.head_dim, config.rms_norm_eps, dtype=dtype)

    def project(
        self, x: Float[Array, "tokens hidden"], plan: AttentionPlan
    ) -> tuple[Float[Array, "tokens q_width"], Float[Array, "tokens kv_width"], Float[Array, "tokens kv_width"]]:
        q, k, v = super().project(x, plan)
        return self.q_norm(q), self.k_norm(k), v


class Olmo2DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False, layer_index: int = 0):
        self.self_attn = Olmo2Attention(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused)
        self.mlp = feed_forward(config, layer_index, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def __call__(
        self,
        x: Float[Array, "tokens hidden"],
        positions: Int[Array, "tokens"],
        kv_pool: KVPool,
        metadata: AttentionMetadata,
        plan: AttentionPlan,
    ) -> tuple[Float[Array, "tokens hidden"], KVPool]:
        """`metadata` names this layer's blocks of the pool (AttentionMetadata.in_layer)."""
        attn_out, kv_pool = self.self_attn(x, positions, kv_pool, metadata, plan)
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(x, plan)), kv_pool


class Olmo2ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with OLMo-2's decoder layer and final norm (an OLMo-2 RMSNorm)."""

    decoder_layer = Olmo2DecoderLayer
    final_norm = Olmo2RMSNorm
