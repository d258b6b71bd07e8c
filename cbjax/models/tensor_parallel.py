"""Which tensor-parallel sizes split a model, and the shape each device holds of a parameter.

Megatron-style, by the family's TensorParallelPlan (cbjax.models.registry): q/k/v and gate/up are
split by output columns, o and down by input rows (one all-reduce after each; each expert of a
mixture-of-experts layer split the same way, tensor parallel within experts; or, with expert
parallelism, the experts placed whole on devices, num_experts / N each), the embedding and the LM
head by vocabulary. When a model has fewer KV heads than devices, each KV head is
replicated until every device holds one (as vLLM and tpu-inference do), so k/v and the KV pool
take a full head per device. No JAX here: `cbjax plan` and the mesh building both use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from cbjax.models.config import ModelConfig
from cbjax.models.registry import TensorParallelPlan, architecture
from cbjax.quantization import int4_groups_dividing


def tensor_parallel_plan(config: ModelConfig) -> TensorParallelPlan:
    return architecture(config.architecture).tensor_parallel


def kv_heads_per_device(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each device holds: an even split, or one replicated head when there are too few."""
    return max(num_kv_heads // tensor_parallel_size, 1)


def is_expert_kernel(path: tuple[str, ...]) -> bool:
    """A MoE layer's stacked experts [E, in, out] (`...mlp.experts.gate_proj.kernel`)."""
    return len(path) >= 3 and path[-3] == "experts" and path[-1] == "kernel"


def is_group_leaf(leaf: str, shape: tuple[int, ...]) -> bool:
    """A quantized projection's per-group scales or mins [groups, out] (groups of consecutive input rows)."""
    return leaf in ("scales", "mins") and len(shape) == 2


def check_whole_groups(params: Mapping[str, Any], config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise naming the projection, K, the group size and what would fit unless every row-parallel
    projection quantized in groups (scales/mins [groups, out] beside a kernel of K input rows: int8
    [K, out] or 4-bit nibbles [K / 2, out]) gives each of `tensor_parallel_size` devices whole groups.
    `params`: name -> anything with .shape and .dtype (numpy or jax arrays, jax.ShapeDtypeStructs)."""
    n, plan = tensor_parallel_size, tensor_parallel_plan(config)
    for name, scales in params.items():
        prefix, _, leaf = name.rpartition(".")
        if not (prefix.rpartition(".")[2] in plan.row_parallel and is_group_leaf(leaf, scales.shape)):
            continue
        kernel = params[f"{prefix}.kernel"]
        k = kernel.shape[0] * (2 if np.dtype(kernel.dtype) == np.uint8 else 1)  # 4-bit: two rows per byte
        groups = scales.shape[0]
        if groups % n:
            sizes = [size for size in valid_tensor_parallel_sizes(config) if groups % size == 0]
            names = int4_groups_dividing(k // n)
            raise ValueError(
                f"{prefix} cannot be split over tensor_parallel_size={n}: its K={k} input rows are in {groups} "
                f"groups of G={k // groups}, and each device's K / {n} = {k // n} rows must hold whole groups; use a "
                f"tensor_parallel_size that divides its {groups} groups ({', '.join(map(str, sizes))}), or a group "
                f"size that divides {k // n}" + (f": quantization={' or '.join(map(repr, names))} of a float checkpoint"
                                                  if names else "")
            )


def tensor_parallel_problems(config: ModelConfig, tensor_parallel_size: int, expert_parallel: bool = False) -> list[str]:
    """Why the model cannot be split over `tensor_parallel_size` devices (empty if it can)."""
    n = tensor_parallel_size
    problems = []
    if config.num_attention_heads % n:
        problems.append(f"num_attention_heads={config.num_attention_heads} is not divisible by {n}")
    kv = config.num_key_value_heads
    if kv % n and n % kv:
        problems.append(f"num_key_value_heads={kv} neither divides by {n} nor divides {n} (for replication)")
    if config.intermediate_size % n:
        problems.append(f"intermediate_size={config.intermediate_size} is not divisible by {n}")
    if config.num_experts and expert_parallel and config.num_experts % n:  # whole experts per device
        problems.append(f"num_experts={config.num_experts} is not divisible by {n} (expert parallel: whole experts "
                        f"per device)")
    if config.num_experts and not expert_parallel and config.moe_intermediate_size % n:  # split like a dense MLP
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size} is not divisible by {n}")
    return problems


def valid_tensor_parallel_sizes(config: ModelConfig, expert_parallel: bool = False) -> list[int]:
    """Every size the model splits over (bounded by the attention heads, each device needing one)."""
    return [n for n in range(1, config.num_attention_heads + 1) if not tensor_parallel_problems(config, n, expert_parallel)]


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError naming the numbers that do not split and the sizes that would."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    problems = tensor_parallel_problems(config, tensor_parallel_size, expert_parallel)
    if problems:
        sizes = ", ".join(map(str, valid_tensor_parallel_sizes(config, expert_parallel)))
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} cannot split this model: {'; '.join(problems)}; "
            f"valid sizes: {sizes}"
        )


def shard_shape(
    path: tuple[str, ...], shape: tuple[int, ...], config: ModelConfig, tensor_parallel_size: int,
    expert_parallel: bool = False,
) -> tuple[int, ...]:
    """The shape one device holds of the parameter at `path` (nnx state path names)."""
    n, plan = tensor_parallel_size, tensor_parallel_plan(config)
    module, name = path[-2], path[-1]
    if expert_parallel and is_expert_kernel(path):  # [E, in, out]: E / N whole experts
        return (shape[0] // n, *shape[1:])
    if module in plan.kv_head_columns:  # KV heads x head_dim, replicated up to one head per device
        heads = config.num_key_value_heads  # a replicated one (OLMo-2's k_norm) holds every repeated head
        per_device = kv_heads_per_device(heads, n) if module in plan.column_parallel else heads * max(n // heads, 1)
        return (*shape[:-1], per_device * config.head_dim)
    if module in plan.column_parallel:
        return (*shape[:-1], shape[-1] // n)
    if module in plan.row_parallel and (name == "kernel" or is_group_leaf(name, shape)):
        return (*shape[:-2], shape[-2] // n, shape[-1])  # [in, out], a MoE layer's experts [E, in, out], [groups, out]
    if module == "embed_tokens":  # [vocab, hidden]; the vocabulary is padded up to a multiple of N
        return (math.ceil(shape[0] / n), *shape[1:])
    if module == "lm_head":  # [hidden, vocab]
        return (*shape[:-1], math.ceil(shape[-1] / n))
    return shape  # norms, row-parallel biases and per-column scales [out]: replicated
