"""Lower every step of a model that is never loaded: weights, pool and state as shapes and shardings only.

`cbjax lower --config llama-3-70b --platform cuda --tensor-parallel-size 8` checks on a CPU host
that every bucket of a 70B model lowers for CUDA with its tensor-parallel shardings, without one
byte of weights: the model is built by nnx.eval_shape, and the runner holds
jax.ShapeDtypeStructs that carry each array's sharding. The mesh is made of this host's CPU
devices (virtual ones: --xla_force_host_platform_device_count), which is enough to lower for
another platform: only the shardings' shape matters, no device runs anything.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from cbjax.checkpoint.params import named_arrays, param_name
from cbjax.models.config import ModelConfig
from cbjax.models.layers.linear import declare_quantized
from cbjax.quantization import check_quantized_lm_head
from cbjax.models.layers.lora import attach_lora
from cbjax.worker.compilation.buckets import Bucket
from cbjax.config import EngineConfig
from cbjax.worker.sample.penalty_state import init_penalty_state
from cbjax.worker.model_runner import ModelRunner
from cbjax.worker.distributed.sharding import TensorParallel
from cbjax.models.registry import model_class
from cbjax.models.tensor_parallel import check_whole_groups


def _placed(tree: Any, sharding: jax.sharding.Sharding | None) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


class AbstractModelRunner(ModelRunner):
    """A ModelRunner over an nnx.eval_shape model: it lowers steps but never allocates or runs one."""

    def _device_state(self, state: nnx.State, init_pool: Any) -> tuple[list[jax.ShapeDtypeStruct], Any, Any, Any]:
        tensor_parallel = self.tensor_parallel
        if tensor_parallel is not None:
            state = nnx.from_flat_state([
                (path, variable.replace(_placed(variable.get_value(), tensor_parallel.weight_sharding(param_name(path), variable.shape))))
                for path, variable in nnx.to_flat_state(state)
            ])
        weights, treedef = jax.tree_util.tree_flatten(state)
        pool_sharding = None if tensor_parallel is None else tensor_parallel.pool_sharding
        replicated = None if tensor_parallel is None else tensor_parallel.replicated
        kv_pool = _placed(jax.eval_shape(init_pool), pool_sharding)
        penalty_state = _placed(
            jax.eval_shape(functools.partial(init_penalty_state, self.config.max_num_seqs, self.model_config.vocab_size)),
            replicated,
        )
        return weights, treedef, kv_pool, penalty_state

    def _replicated_zeros(self, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return _placed(jax.ShapeDtypeStruct(shape, jnp.int32), None if self.tensor_parallel is None else self.tensor_parallel.replicated)


def abstract_runner(model_config: ModelConfig, config: EngineConfig, platform: str) -> AbstractModelRunner:
    """The runner `config` would build for this model on `platform`, from shapes alone.

    The pool holds num_kv_blocks, or max_num_seqs requests of max_model_len (its size is only a
    dimension here). On the tensor-parallel mesh of this host's CPU devices.
    """
    # Nothing it lowers is compiled, so it has no step cache (whose device a shape does not have).
    config = dataclasses.replace(config, compilation_cache_dir=None)
    config.resolve(model_config.max_position_embeddings)
    check_quantized_lm_head(config.quantize_lm_head, config.quantization, config.tensor_parallel_size)
    tensor_parallel = None
    if config.tensor_parallel_size > 1:
        tensor_parallel = TensorParallel.create(model_config, config.tensor_parallel_size, jax.devices("cpu"),
                                                expert_parallel=config.enable_expert_parallel)
        model_config = tensor_parallel.serving_config(model_config)
    on_cpu = platform == "cpu"
    dtype = config.dtype if config.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    activation_dtype = jnp.float32 if on_cpu else None  # as LLMEngine: float32 activations on CPU only

    def build() -> nnx.Module:  # as LLMEngine loads it
        model = declare_quantized(
            model_class(model_config)(model_config, dtype=jnp.dtype(dtype), activation_dtype=activation_dtype,
                                      rngs=nnx.Rngs(0), fused_projections=tensor_parallel is None),
            config.quantization, lm_head=config.quantize_lm_head,
        )
        if config.enable_lora:
            attach_lora(model, model_config, config.max_loras, config.max_lora_rank)
        return model

    model = nnx.eval_shape(build)
    if tensor_parallel is not None:
        check_whole_groups(named_arrays(nnx.state(model)), model_config, tensor_parallel.size)
    num_blocks = config.num_kv_blocks or config.max_num_seqs * math.ceil(config.max_model_len / config.block_size) + 1
    return AbstractModelRunner(model, model_config, config, num_blocks, "pallas", tensor_parallel)


def argument_shardings(lowered_text: str) -> collections.Counter[str]:
    """How many arguments of a lowered step's main function carry each sharding (Shardy's notation,
    e.g. `[{}, {"model"}]`: the second dimension split over the mesh's model axis)."""
    signature = re.search(r"func\.func public @main\((.*?)\) ->", lowered_text, re.S)
    if signature is None:
        return collections.Counter()
    return collections.Counter(re.findall(r"#sdy\.sharding<@mesh, (\[.*?\])>", signature.group(1)))


def num_partitions(lowered_text: str) -> int:
    """The devices a lowered step is partitioned over (1 without a mesh)."""
    found = re.search(r"mhlo\.num_partitions = (\d+)", lowered_text)
    return int(found.group(1)) if found else 1
