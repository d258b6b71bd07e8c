"""Tensor parallelism in one process: the mesh, the partition spec of each weight and of the KV pool.

Megatron-style, by the family's TensorParallelPlan (cbjax.models.registry): q/k/v and gate/up are
split by output columns (whole heads per device), o and down by input rows (XLA adds one all-reduce
after each), the embedding and LM head by vocabulary. A quantized projection's scales (and 4-bit mins)
go with its kernel: per column [out] with the columns (replicated beside o/down's rows); per group
[groups, out] by columns, or for o/down by groups, whole groups per device (check_whole_groups). With expert parallelism a MoE layer's
stacked experts [E, in, out] are split by expert instead (E / size whole experts per device);
attention and the dense layers stay as above. Which sizes split a model is
cbjax.models.tensor_parallel's rule (shared with `cbjax plan`).
The KV pool [kv_heads, blocks, block_size, head_dim] is split over KV heads, and attention runs
per device under shard_map (cbjax.models.layers.attention). When a model has fewer KV heads than
devices, each KV head is repeated until there is one per device, as tpu-inference does: a query
head still reads the same K/V, and the pool costs `tp / num_kv_heads` times the bytes.

One mesh axis, MODEL_AXIS; a multi-host mesh is the same mesh over every process's devices.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cbjax.checkpoint.params import param_name
from cbjax.models.config import ModelConfig
from cbjax.models.registry import TensorParallelPlan
from cbjax.models.tensor_parallel import (
    check_tensor_parallel,
    is_expert_kernel,
    is_group_leaf,
    tensor_parallel_plan,
    valid_tensor_parallel_sizes,
)
from cbjax.models.layers.mesh import MODEL_AXIS

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The mesh and the shardings of one model over `size` devices."""

    mesh: Mesh
    size: int
    kv_repeats: int  # how many copies of each KV head the pool holds (1 unless kv_heads < size)
    shard_vocab: bool  # the embedding and LM head split by vocabulary (needs vocab % size == 0)
    plan: TensorParallelPlan  # which of the family's modules split how
    expert_parallel: bool = False  # MoE experts placed whole on devices instead of split within each

    @classmethod
    def create(cls, config: ModelConfig, size: int, devices: list[jax.Device] | None = None,
               expert_parallel: bool = False) -> TensorParallel:
        """Check that `size` can work for this model on these devices, then build the mesh."""
        devices = list(jax.devices() if devices is None else devices)
        if size > len(devices):
            valid = [n for n in valid_tensor_parallel_sizes(config, expert_parallel) if n <= len(devices)]
            raise ValueError(
                f"tensor_parallel_size={size} asks for more devices than the {len(devices)} present "
                f"({devices[0].platform}); use at most {len(devices)} (valid sizes for this model: {valid})"
            )
        check_tensor_parallel(config, size, expert_parallel)  # heads, MLPs, experts split evenly, or it names sizes
        kv_repeats = max(size // config.num_key_value_heads, 1)
        shard_vocab = config.vocab_size % size == 0
        if kv_repeats > 1:
            logger.warning(
                "tensor_parallel_size=%d > num_key_value_heads=%d: each KV head is repeated %dx so every device holds "
                "one; the KV pool costs %dx the bytes of an unrepeated one",
                size, config.num_key_value_heads, kv_repeats, kv_repeats,
            )
        if not shard_vocab and size > 1:
            logger.warning(
                "vocab_size=%d is not divisible by tensor_parallel_size=%d: the embedding and LM head are replicated "
                "on every device", config.vocab_size, size,
            )
        mesh = Mesh(np.asarray(devices[:size]), (MODEL_AXIS,))
        return cls(mesh=mesh, size=size, kv_repeats=kv_repeats, shard_vocab=shard_vocab, plan=tensor_parallel_plan(config),
                   expert_parallel=expert_parallel)

    def serving_config(self, config: ModelConfig) -> ModelConfig:
        """The model as served: KV heads counted after repetition."""
        return dataclasses.replace(config, num_key_value_heads=config.num_key_value_heads * self.kv_repeats)

    def repeat_kv_heads(self, params: dict[str, np.ndarray | jax.Array], config: ModelConfig) -> dict[str, np.ndarray | jax.Array]:
        """The plan's kv_head_columns (k_proj/v_proj kernels and biases, and the like) with each KV head's
        columns repeated kv_repeats times, in place.

        Copies of a head sit next to each other, so query head h still meets KV head h // group.
        """
        if self.kv_repeats == 1:
            return params
        for name in [n for n in params if self._is_kv_head_columns(n)]:
            columns = np.asarray(params[name])
            heads = columns.reshape(*columns.shape[:-1], config.num_key_value_heads, config.head_dim)
            params[name] = np.repeat(heads, self.kv_repeats, axis=-2).reshape(*columns.shape[:-1], -1)
        return params

    def weight_spec(self, name: str, shape: tuple[int, ...]) -> P:
        """The partition spec of the parameter at dotted path `name`, of this shape."""
        parts = name.split(".")
        module, leaf = parts[-2], parts[-1]
        if "lora" in parts:
            return self._lora_spec(parts[parts.index("lora") - 1], parts[parts.index("lora") + 1], len(shape))
        if self.expert_parallel and is_expert_kernel(tuple(parts)):
            return P(MODEL_AXIS, None, None)  # whole experts per device
        if leaf == "grid":  # the 16 values a 4-bit kernel's nibbles index: every device's whole
            return P()
        stacked = (None,) * (len(shape) - 2) if leaf == "kernel" else ()  # a MoE layer's experts: [E, in, out]
        if module in self.plan.column_parallel:  # kernels, biases and scales/mins ([out] or [groups, out]) by columns
            return P(*stacked, None, MODEL_AXIS) if leaf == "kernel" else P(*(None,) * (len(shape) - 1), MODEL_AXIS)
        if module == "lm_head" and self.shard_vocab:
            return P(None, MODEL_AXIS)
        if module in self.plan.row_parallel and (leaf == "kernel" or is_group_leaf(leaf, shape)):
            return P(*stacked, MODEL_AXIS, None)  # input rows; groups of them (check_whole_groups: whole per device)
        if name == "model.embed_tokens.embedding" and self.shard_vocab:
            return P(MODEL_AXIS, None)
        if module == "tied_head" and shape[-1] % self.size == 0:
            return P(None, MODEL_AXIS)  # a column block of the transposed embedding
        return P()

    def _lora_spec(self, projection: str, factor: str, ndim: int) -> P:
        """A LoRA factor split as the projection it adapts (models/layers/lora.py): a column-parallel one's B
        [slots, rank, out] by output columns, a row-parallel one's A [parts, slots, rank, in] by input rows
        (XLA all-reduces x @ A.T, as it does the base product); the other factor whole on every device."""
        if projection in self.plan.column_parallel and factor == "b":
            return P(*(None,) * (ndim - 1), MODEL_AXIS)
        if projection in self.plan.row_parallel and factor == "a":
            return P(*(None,) * (ndim - 1), MODEL_AXIS)
        return P()

    def weight_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.weight_spec(name, shape))

    def restore_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        """Where the checkpoint restores a tensor: its final sharding, except k/v projections that are
        still to be repeated (replicated: they are small, and repeating regroups their columns)."""
        if self.kv_repeats > 1 and self._is_kv_head_columns(name):
            return self.replicated
        return self.weight_sharding(name, shape)

    def shard_state(self, state: nnx.State) -> nnx.State:
        """Every weight in its sharding: a no-op for loaded parameters, a move for derived ones."""
        return nnx.from_flat_state([
            (path, variable.replace(jax.device_put(variable.get_value(), self.weight_sharding(param_name(path), variable.shape))))
            for path, variable in nnx.to_flat_state(state)
        ])

    def _is_kv_head_columns(self, name: str) -> bool:
        parts = name.split(".")
        return len(parts) >= 2 and parts[-2] in self.plan.kv_head_columns

    @property
    def pool_sharding(self) -> NamedSharding:
        """One layer's K or V pages [kv_heads, blocks, block_size, head_dim], split over KV heads."""
        return NamedSharding(self.mesh, P(MODEL_AXIS))

    @property
    def replicated(self) -> NamedSharding:
        """The packed step inputs and outputs, and the logits the sampler reads: whole on every device."""
        return NamedSharding(self.mesh, P())


def step_shardings(tensor_parallel: TensorParallel, weights: list[jax.Array]) -> dict[str, tuple]:
    """jax.jit's in/out shardings of a step (weights, kv_pool, penalty_state, last_sampled, block_table,
    packed, grammar_bitmask) -> (kv_pool, penalty_state, last_sampled, block_table, packed); the penalty
    state is whole on every device, as the sampler reads it, and so are the block table and the masks."""
    pool, replicated = tensor_parallel.pool_sharding, tensor_parallel.replicated
    return {
        "in_shardings": ([w.sharding for w in weights], pool, replicated, replicated, replicated, replicated, replicated),
        "out_shardings": (pool, replicated, replicated, replicated, replicated),
    }
