"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and with experts in their MLPs Qwen3-MoE and
Mixtral) in flax.nnx, written for the paged engine; its layers are the ones other families
(cbjax.models.olmo2) compose.

Module and parameter names mirror Hugging Face's (`model.layers.3.self_attn.q_proj`), so the
checkpoint mapping is one rule per parameter kind. Linear kernels are [in, out] (HF's transposed),
or on a CPU packed for the C++ matmul kernel at load (`pack_linears`).

One forward runs a flat ragged batch of new tokens: each layer writes its new K/V into its
blocks of the page pool, then attends over them. The pool is one K and one V array for all
layers, layer l's copy of block b at l * num_blocks + b (layers/kv_pool.py): a step's call passes
two pool arrays, not two per layer (JAX's dispatch pays per array; see `hidden_states`).
Nothing is mutated in __call__: the updated pool is returned, so `nnx.merge(graphdef, state)`
inside a jitted function traces cleanly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from cbjax.models.config import ModelConfig
from cbjax.models.layers.attention import AttentionPlan, write_kv_and_attend
from cbjax.models.layers.embedding import embedding_rows, quantized_table
from cbjax.models.layers.kv_pool import KVPool
from cbjax.models.layers.linear import kernel_product, linear
from cbjax.models.layers.moe import SparseMoeBlock
from cbjax.models.layers.norm import RMSNorm
from cbjax.models.layers.rope import rope_cos_sin, rope_inv_freq, rotate
from kernels_cpu import pack_weight, packable
from kernels_pallas.reference import AttentionMetadata

# Column blocks of the transposed tied head: separate arrays, as slicing one array inside the step
# makes XLA:CPU copy it, and XLA:CPU runs their dots side by side (benchmarks/decode_dots_bandwidth.py --tied-head).
TIED_HEAD_PARTS = 4
# ModelConfig.hidden_act -> the MLP's gate activation; gelu_pytorch_tanh is GELU's tanh approximation.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class DerivedWeight(nnx.Variable):
    """Computed from parameters after loading (never stored in or checked against a checkpoint)."""


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False, layer_index: int = 0):
        hidden, head_dim = config.hidden_size, config.head_dim
        self.config = config
        # What sets one layer apart, all static. Not the layer's index: layers alike in these share one
        # graphdef, so a step traces them once (_decoder_layer).
        self.rope = config.rope(layer_index)  # (base, scaling): Gemma 3's local layers have their own
        self.sliding_window = config.sliding_window(layer_index)  # None for full attention
        # An fp8 pool's (k_scale, v_scale) for this layer: 1.0 unless calibrated at start-up (worker/kv_scales.py),
        # when each layer has its own and traces on its own.
        self.kv_scales = (1.0, 1.0)
        projection = lambda i, o, bias: linear(i, o, bias, dtype, rngs, activation_dtype)  # noqa: E731
        q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        self.fused = fused
        if fused:  # q, k and v columns side by side in one kernel (fuse_projections)
            self.qkv_proj = projection(hidden, q_width + 2 * kv_width, config.attention_bias)
        else:
            self.q_proj = projection(hidden, q_width, config.attention_bias)
            self.k_proj = projection(hidden, kv_width, config.attention_bias)
            self.v_proj = projection(hidden, kv_width, config.attention_bias)
        self.o_proj = projection(config.num_attention_heads * head_dim, hidden, config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype)

    def __call__(
        self,
        x: Float[Array, "tokens hidden"],
        positions: Int[Array, "tokens"],
        kv_pool: KVPool,
        metadata: AttentionMetadata,
        plan: AttentionPlan,
    ) -> tuple[Float[Array, "tokens hidden"], KVPool]:
        config = self.config
        num_tokens = x.shape[0]
        q, k, v = self.project(x, plan)
        q = q.reshape(num_tokens, config.num_attention_heads, config.head_dim)
        k = k.reshape(num_tokens, config.num_key_value_heads, config.head_dim)
        v = v.reshape(num_tokens, config.num_key_value_heads, config.head_dim)
        if config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # One cos and sin per token for q's and k's heads alike.
        cos, sin = rope_cos_sin(positions, rope_inv_freq(config.head_dim, *self.rope))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out, kv_pool = write_kv_and_attend(q, k, v, kv_pool, metadata, config.sm_scale, plan, self.sliding_window,
                                           self.kv_scales)
        return self.o_proj(out.reshape(num_tokens, -1), plan), kv_pool


    def project(
        self, x: Float[Array, "tokens hidden"], plan: AttentionPlan
    ) -> tuple[Float[Array, "tokens q_width"], Float[Array, "tokens kv_width"], Float[Array, "tokens kv_width"]]:
        """q, k and v, each heads x head_dim wide (split from the fused kernel's columns where fused)."""
        if self.fused:
            q_width = self.config.num_attention_heads * self.config.head_dim
            kv_width = self.config.num_key_value_heads * self.config.head_dim
            return tuple(jnp.split(self.qkv_proj(x, plan), [q_width, q_width + kv_width], axis=-1))
        return self.q_proj(x, plan), self.k_proj(x, plan), self.v_proj(x, plan)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False):
        hidden, inner = config.hidden_size, config.intermediate_size
        self.hidden_act = config.hidden_act
        self.fused = fused
        if fused:  # gate and up columns side by side in one kernel (fuse_projections)
            self.gate_up_proj = linear(hidden, 2 * inner, config.mlp_bias, dtype, rngs, activation_dtype)
        else:
            self.gate_proj = linear(hidden, inner, config.mlp_bias, dtype, rngs, activation_dtype)
            self.up_proj = linear(hidden, inner, config.mlp_bias, dtype, rngs, activation_dtype)
        self.down_proj = linear(inner, hidden, config.mlp_bias, dtype, rngs, activation_dtype)

    def __call__(self, x: Float[Array, "tokens hidden"], plan: AttentionPlan = AttentionPlan()) -> Float[Array, "tokens hidden"]:
        if self.fused:
            gate, up = jnp.split(self.gate_up_proj(x, plan), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x, plan), self.up_proj(x, plan)
        return self.down_proj(ACTIVATIONS[self.hidden_act](gate) * up, plan)


def feed_forward(config: ModelConfig, layer_index: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 activation_dtype: jnp.dtype | None, fused: bool) -> MLP | SparseMoeBlock:
    """Layer `layer_index`'s MLP: the router and experts where the config makes the layer sparse, else dense."""
    if layer_index in config.sparse_layers:
        return SparseMoeBlock(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype)
    return MLP(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False, layer_index: int = 0):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused,
                                   layer_index=layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = feed_forward(config, layer_index, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused)

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
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x), plan), kv_pool


@functools.partial(jax.jit, static_argnums=(0, 6))
def _decoder_layer(
    graphdef: nnx.GraphDef, state: nnx.State, x: Float[Array, "tokens hidden"], positions: Int[Array, "tokens"],
    kv_pool: KVPool, metadata: AttentionMetadata, plan: AttentionPlan,
) -> tuple[Float[Array, "tokens hidden"], KVPool]:
    """One decoder layer as its own jitted function: layers alike in structure, shapes and static
    attributes share one graphdef, so a step traces and lowers the layer once per kind (one for
    Llama, two for Gemma 3's local and global layers) and calls it num_hidden_layers times (XLA
    inlines the calls before optimizing, so the compiled step is the unrolled one). Per-layer fp8
    scales (calculate_kv_scales) make every layer its own kind."""
    return nnx.merge(graphdef, state)(x, positions, kv_pool, metadata, plan)


class LlamaModel(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 fused: bool = False, decoder_layer: type[nnx.Module] = DecoderLayer,
                 final_norm: type[RMSNorm] = RMSNorm):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([
            decoder_layer(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused, layer_index=index)
            for index in range(config.num_hidden_layers)
        ])
        self.norm = final_norm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nnx.Module):
    """`dtype`: weights (and, unless `activation_dtype` is given, everything else).

    `activation_dtype` (e.g. float32 with bfloat16 weights): the residual stream, norms,
    attention and KV pool stay in it, and each matmul takes `dtype` inputs and accumulates
    into it. XLA:CPU runs such bf16 x bf16 -> f32 dots about 1.6-1.8x faster than f32 ones,
    while all-bf16 arithmetic there is several times slower than f32.

    `fused_projections`: each layer's q/k/v kernels as one `qkv_proj` and gate/up as one
    `gate_up_proj` (their columns side by side; `fuse_projections` makes them from a checkpoint's
    separate ones): two dots fewer per layer, and 3 arrays fewer per layer in every step's call.

    A family that differs only inside its decoder layer (cbjax.models.olmo2) subclasses this with its
    own `decoder_layer` (and `final_norm`): the embedding, the layer loop over the paged pool and the head stay these.
    """

    decoder_layer: type[nnx.Module] = DecoderLayer
    final_norm: type[RMSNorm] = RMSNorm

    def __init__(
        self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs,
        activation_dtype: jnp.dtype | None = None, fused_projections: bool = False,
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.activation_dtype = jnp.dtype(activation_dtype or dtype)
        self.model = LlamaModel(config, dtype=dtype, rngs=rngs, activation_dtype=activation_dtype, fused=fused_projections,
                                decoder_layer=self.decoder_layer, final_norm=self.final_norm)
        # Tied models reuse the embedding matrix as the LM head, so there is no lm_head parameter.
        self.lm_head = None if config.tie_word_embeddings else linear(
            config.hidden_size, config.vocab_size, False, dtype, rngs, activation_dtype
        )
        # With 16-bit weights under float32 activations, a transposed copy of a tied table: XLA:CPU
        # only runs the bf16 -> f32 dot with the weight as [in, out]; with the table as [out, in]
        # it converts all of it to float32 on every step. It is kept as TIED_HEAD_PARTS column blocks,
        # separate arrays whose dots XLA:CPU runs side by side. Filled by derive_weights().
        mixed = self.activation_dtype != self.dtype
        self.tied_head = nnx.List([
            DerivedWeight(jnp.zeros((config.hidden_size, len(columns)), dtype))
            for columns in np.array_split(np.arange(config.vocab_size), TIED_HEAD_PARTS)
        ]) if config.tie_word_embeddings and mixed else None

    def derive_weights(self) -> None:
        """Recompute the DerivedWeights from the parameters (call after loading them)."""
        if self.tied_head is not None and self.tied_head[0].ndim == 3:  # pack_tied_head's panels
            self.tied_head[0][...] = self._packed_head()
        elif self.tied_head is not None:
            table = self.model.embed_tokens.embedding[...].T
            for part, columns in zip(self.tied_head, jnp.array_split(table, TIED_HEAD_PARTS, axis=1)):
                part[...] = columns

    def pack_tied_head(self) -> None:
        """Hold the transposed copy of a tied 16-bit table as one kernel packed for the C++ matmul, which
        streams it at a decode step's few rows faster than XLA:CPU's bf16 dots, and on AMX tiles at a prompt
        step's many (`python -m benchmarks.decode_dots_bandwidth --packed --dtype bfloat16 --tied-head`). A
        no-op where there is no such copy or its dtype or width does not pack."""
        if self.tied_head is None or not packable((self.config.hidden_size, self.config.vocab_size), self.dtype):
            return
        self.tied_head = nnx.List([DerivedWeight(self._packed_head())])

    def _packed_head(self) -> Array:
        """The tied table transposed to the head's [hidden, vocab] kernel, in panels for the C++ matmul."""
        return jnp.asarray(pack_weight(np.asarray(self.model.embed_tokens.embedding[...]).T))

    def __call__(
        self,
        token_ids: Int[Array, "tokens"],
        positions: Int[Array, "tokens"],
        kv_pool: KVPool,
        metadata: AttentionMetadata,
        logits_indices: Int[Array, "samples"],
        plan: AttentionPlan = AttentionPlan(),
    ) -> tuple[Float[Array, "samples vocab"], KVPool]:
        """Logits (float32) at rows `logits_indices` of the batch, and the updated pool."""
        hidden, kv_pool = self.hidden_states(token_ids, positions, kv_pool, metadata, plan)
        # Gather before the norm and head: only the sampled rows ever pay for the vocab projection.
        return self.compute_logits(hidden[logits_indices], plan), kv_pool

    def hidden_states(
        self,
        token_ids: Int[Array, "tokens"],
        positions: Int[Array, "tokens"],
        kv_pool: KVPool,
        metadata: AttentionMetadata,
        plan: AttentionPlan = AttentionPlan(),
    ) -> tuple[Float[Array, "tokens hidden"], KVPool]:
        """The last layer's output at every token (before the final norm), and the updated pool.

        `metadata` names block ids 0..num_blocks-1, as the block manager hands them out; each layer
        gets them moved to its own blocks of the pool. One pool array for all layers, not one per
        layer: a step's call paid about 1 us per donated array, 60 of them for SmolLM2's 30 layers.
        """
        num_layers = self.config.num_hidden_layers
        pages = kv_pool[0].shape[1] if isinstance(kv_pool, tuple) and len(kv_pool) == 2 else 0
        num_blocks = pages // num_layers
        if not num_blocks or pages % num_layers:
            raise ValueError(
                f"the KV pool must be one (K, V) pair with num_hidden_layers ({num_layers}) x num_blocks pages "
                f"on axis 1; got {[getattr(x, 'shape', x) for x in kv_pool]}. Build it with init_kv_pool(config, ...)"
            )
        x = self.embed(token_ids)
        for index, layer in enumerate(self.model.layers):
            graphdef, state = nnx.split(layer)
            layer_metadata = metadata.in_layer(index * num_blocks, kv_pool[0].shape[2])
            x, kv_pool = _decoder_layer(graphdef, state, x, positions, kv_pool, layer_metadata, plan)
        return x, kv_pool

    def embed(self, token_ids: Int[Array, "tokens"]) -> Float[Array, "tokens hidden"]:
        """The embedding rows of `token_ids`, in the activation dtype."""
        # A plain row gather (of a quantized table's rows, dequantized): Embed's own call would convert the
        # whole table to the activation dtype.
        return embedding_rows(self.model.embed_tokens, token_ids).astype(self.activation_dtype)

    def compute_logits(self, hidden: Float[Array, "rows hidden"], plan: AttentionPlan = AttentionPlan()) -> Float[Array, "rows vocab"]:
        """Final norm and LM head: float32 logits of the given rows of hidden_states. A tied head whose
        table is kept quantized (layers/embedding.py) multiplies it as a quantized kernel, by the C++
        kernel where the plan runs them."""
        x = self.model.norm(hidden)
        table, quantized = quantized_table(self.model.embed_tokens)
        if self.lm_head is None and quantized:
            logits = kernel_product(x, table, quantized, plan)
        elif self.tied_head is not None and self.tied_head[0].ndim == 3:
            logits = kernel_product(x, self.tied_head[0][...], [], plan)
        elif self.tied_head is not None:
            x16 = x.astype(self.dtype)
            logits = jnp.concatenate(
                [jnp.dot(x16, part[...], preferred_element_type=self.activation_dtype) for part in self.tied_head], axis=-1
            )
        elif self.lm_head is None:
            # Not Embed.attend: that casts the whole table to the activation dtype every step. The
            # table stays the left operand, untransposed, so XLA:CPU can use its bf16 dot directly.
            logits = jnp.dot(table, x.astype(table.dtype).T, preferred_element_type=self.activation_dtype).T
        else:
            logits = self.lm_head(x, plan)
        return logits.astype(jnp.float32)
