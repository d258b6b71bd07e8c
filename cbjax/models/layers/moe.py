"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a softmax top-k router and experts held as
stacked kernels [num_experts, in, out], computed inside the jitted step with static shapes.

Two formulations of the experts' products, equal up to float rounding:
  "grouped"       each (token, chosen expert) pair sorted by expert, the three projections as
                  grouped matmuls (jax.lax.ragged_dot, group sizes from a bincount of the expert
                  ids), then unsorted and summed with the routing weights: tokens x top_k rows.
  "dense_masked"  every expert on every token, weighted by a routing matrix that is zero off each
                  token's top k: tokens x num_experts rows, no sort or gather.
MOE_MATMUL_BY_PLATFORM keeps the faster per platform, as benchmarks/moe_matmul.py measured it; the
choice is made when the step is lowered (jax.lax.platform_dependent), so a step lowered for CUDA
on a CPU machine (`cbjax lower`) takes the GPU's formulation.
Under tensor parallelism every expert is split Megatron-style (gate/up by columns, down by rows)
and each device runs its slice under shard_map, then one all-reduce (a psum) sums them.
Under expert parallelism (plan.expert_parallel, vLLM's enable_expert_parallel) the same stacked
kernels are split by expert instead: each device holds num_experts / N whole experts and computes
their contributions for the tokens routed to them (the other devices' experts count as no expert),
then the same psum sums them. The hidden states are replicated between layers, so every device
already has every token and no all-to-all dispatch is needed; an all-to-all (tokens sent to their
experts' devices and back) pays off only when tokens are sharded over devices, as under
data-parallel attention, which this engine does not have.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from cbjax.models.config import ModelConfig
from cbjax.models.layers.attention import AttentionPlan
from cbjax.models.layers.linear import linear
from cbjax.models.layers.mesh import MODEL_AXIS

# XLA:CPU: dense-masked at every step shape of the tiny and small configs (benchmarks/moe_matmul.py,
# BENCHMARKS.md "Mixture-of-experts matmul"). Other platforms: grouped, the fewer FLOPs (not yet measured).
MOE_MATMUL_BY_PLATFORM = {"cpu": "dense_masked"}
DEFAULT_MOE_MATMUL = "grouped"


def route(
    router_logits: Float[Array, "tokens experts"], top_k: int, renormalize: bool
) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
    """Each token's top_k experts and their weights: softmax probabilities in float32 (as transformers'
    routers compute them), renormalized to sum to 1 where the family does (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def experts_grouped(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens top_k"],
    experts: Int[Array, "tokens top_k"],
    gate: Float[Array, "experts hidden inner"],
    up: Float[Array, "experts hidden inner"],
    down: Float[Array, "experts inner hidden"],
    out_dtype: jnp.dtype,
) -> Float[Array, "tokens hidden"]:
    """Sorted by expert, three grouped matmuls, unsorted and weighted."""
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # row r of the sorted batch is pair order[r] = (token, k)
    rows = x[order // top_k].astype(gate.dtype)
    group_sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    dot = functools.partial(jax.lax.ragged_dot, group_sizes=group_sizes, preferred_element_type=out_dtype)
    hidden = jax.nn.silu(dot(rows, gate)) * dot(rows, up)
    out = dot(hidden.astype(down.dtype), down)[jnp.argsort(order)].reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkh,tk->th", out, weights.astype(out.dtype))


def experts_dense_masked(
    x: Float[Array, "tokens hidden"],
    weights: Float[Array, "tokens top_k"],
    experts: Int[Array, "tokens top_k"],
    gate: Float[Array, "experts hidden inner"],
    up: Float[Array, "experts hidden inner"],
    down: Float[Array, "experts inner hidden"],
    out_dtype: jnp.dtype,
) -> Float[Array, "tokens hidden"]:
    """Every expert on every token; the routing matrix scales each expert's inner activations, so
    the down projection and the sum over experts are one matmul over (expert, inner)."""
    num_tokens, num_experts = x.shape[0], gate.shape[0]
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(experts, num_experts, dtype=weights.dtype))
    x16 = x.astype(gate.dtype)
    hidden = (jax.nn.silu(jnp.einsum("th,ehi->tei", x16, gate, preferred_element_type=out_dtype))
              * jnp.einsum("th,ehi->tei", x16, up, preferred_element_type=out_dtype))
    scaled = (hidden * combine[:, :, None].astype(out_dtype)).reshape(num_tokens, -1)
    return jnp.dot(scaled.astype(down.dtype), down.reshape(-1, down.shape[-1]), preferred_element_type=out_dtype)


MOE_MATMULS = {"grouped": experts_grouped, "dense_masked": experts_dense_masked}


def experts_per_platform(*args, out_dtype: jnp.dtype) -> Float[Array, "tokens hidden"]:
    """MOE_MATMUL_BY_PLATFORM's formulation for the platform the step is lowered for."""
    per_platform = {platform: functools.partial(MOE_MATMULS[name], out_dtype=out_dtype)
                    for platform, name in MOE_MATMUL_BY_PLATFORM.items()}
    return jax.lax.platform_dependent(
        *args, default=functools.partial(MOE_MATMULS[DEFAULT_MOE_MATMUL], out_dtype=out_dtype), **per_platform)


def local_experts(
    weights: Float[Array, "tokens top_k"], experts: Int[Array, "tokens top_k"], num_local: int
) -> tuple[Float[Array, "tokens top_k"], Int[Array, "tokens top_k"]]:
    """Inside shard_map over MODEL_AXIS: each choice's index among this device's num_local experts, or
    num_local (no expert here: a zero one-hot row, a row past the grouped matmul's groups) with weight 0."""
    local = experts - jax.lax.axis_index(MODEL_AXIS) * num_local
    here = (local >= 0) & (local < num_local)
    return jnp.where(here, weights, 0), jnp.where(here, local, num_local)


class ExpertKernel(nnx.Module):
    """One projection of every expert, stacked: kernel [num_experts, in, out]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(batch_axis=(0,))
        self.kernel = nnx.Param(init(rngs.params(), (num_experts, in_features, out_features), dtype))


class Experts(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        num_experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_proj = ExpertKernel(num_experts, hidden, inner, dtype=dtype, rngs=rngs)
        self.up_proj = ExpertKernel(num_experts, hidden, inner, dtype=dtype, rngs=rngs)
        self.down_proj = ExpertKernel(num_experts, inner, hidden, dtype=dtype, rngs=rngs)


class SparseMoeBlock(nnx.Module):
    """The router (`gate`, [hidden, num_experts]) and the experts; replaces the MLP of a sparse layer."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation_dtype: jnp.dtype | None = None,
                 moe_matmul: str | None = None):
        self.config = config
        self.activation_dtype = jnp.dtype(activation_dtype or dtype)
        self.moe_matmul = moe_matmul  # one of MOE_MATMULS; None: the platform's (MOE_MATMUL_BY_PLATFORM)
        self.gate = linear(config.hidden_size, config.num_experts, False, dtype, rngs, activation_dtype)
        self.experts = Experts(config, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "tokens hidden"], plan: AttentionPlan = AttentionPlan()) -> Float[Array, "tokens hidden"]:
        config = self.config
        weights, experts = route(self.gate(x, plan), config.num_experts_per_tok, config.norm_topk_prob)
        kernels = (self.experts.gate_proj.kernel[...], self.experts.up_proj.kernel[...], self.experts.down_proj.kernel[...])
        matmul = functools.partial(experts_per_platform if self.moe_matmul is None else MOE_MATMULS[self.moe_matmul],
                                   out_dtype=self.activation_dtype)
        if plan.mesh is None:
            return matmul(x, weights, experts, *kernels).astype(x.dtype)
        if plan.expert_parallel:  # each device: its whole experts, the other devices' counted as none
            num_local = config.num_experts // plan.mesh.shape[MODEL_AXIS]
            kernel_specs = (P(MODEL_AXIS, None, None),) * 3
            per_device = lambda x, weights, experts, *local_kernels: matmul(  # noqa: E731
                x, *local_experts(weights, experts, num_local), *local_kernels)
        else:  # each device: its columns of every expert's gate/up and rows of down
            columns, rows = P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None)
            kernel_specs, per_device = (columns, columns, rows), matmul
        # Either way each device holds a partial sum of the output.
        per_shard = jax.shard_map(
            lambda *args: jax.lax.psum(per_device(*args), MODEL_AXIS),
            mesh=plan.mesh, in_specs=(P(), P(), P(), *kernel_specs), out_specs=P(),
        )
        return per_shard(x, weights, experts, *kernels).astype(x.dtype)
