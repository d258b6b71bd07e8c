"""`cbjax plan`: what a model needs per device under tensor parallelism, and a decode roofline.

Everything comes from the engine's own code: the model's parameters are those the engine builds
(shapes only, nothing allocated, the architecture's registry entry's class), split by the Megatron
rules of `models/tensor_parallel.py`; the pool's bytes per block are the registry's
`kv_cache_bytes_per_block`, and its size is `plan_num_blocks` given
the device's published memory with the weights in use. With a quantization the decoder projections
count what the engine stores (declare_quantized): "int8" 1 byte a weight and a float32 scale a column,
"int4-gG" half a byte a weight and a float32 scale and min per G inputs a column; embeddings, the LM head
and MoE experts stay in dtype. A GGUF file (`--config FILE.gguf`) counts what the loader makes of its tensors
(gguf_params.gguf_stored_shapes: the quantized ones as stored, the rest in dtype), from its tensor list alone.
Presets (cbjax/plan/presets/*.json) are the Hugging Face config.json files of meta-llama/Meta-Llama-3-8B,
Meta-Llama-3-70B, Llama-3.1-8B, Llama-3.1-70B, Qwen/Qwen2.5-7B-Instruct, Qwen2.5-72B-Instruct, and the
mixture-of-experts Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1.

A mixture-of-experts model counts every expert's weights in memory, and per token only the top-k
experts' (its active parameters). Its decode roofline reads, per layer, the experts a batch of b
tokens is expected to touch under uniform routing: num_experts x (1 - (1 - top_k / num_experts)^b).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from cbjax.plan.accelerators import Accelerator
from cbjax.models.config import ModelConfig
from cbjax.checkpoint.params import named_arrays
from cbjax.config import EngineConfig
from cbjax.core.kv.sizing import plan_num_blocks
from cbjax.worker.model_runner import kv_cache_dtype
from cbjax.models.layers.linear import declare_quantized
from cbjax.quantization import check_quantized_lm_head
from cbjax.models.registry import kv_cache_bytes_per_block, model_class
from cbjax.models.tensor_parallel import (
    check_tensor_parallel,
    check_whole_groups,
    kv_heads_per_device,
    shard_shape,
    valid_tensor_parallel_sizes,
)

PRESETS_DIR = Path(__file__).parent / "presets"
AS_STORED = "GGUF as stored"  # a plan's quantization for a GGUF file: its quantized tensors as the engine keeps them
FP8_AS_STORED = "fp8 as stored"  # an fp8 checkpoint's: its projections a byte a weight (checkpoint/fp8_checkpoint.py)
ROOFLINE_BATCH_SIZES = tuple(2**i for i in range(9))  # 1 .. 256


@dataclasses.dataclass(frozen=True)
class RooflinePoint:
    """One decode step of `batch_size` sequences, each attending over the plan's context_len."""

    batch_size: int
    bytes_read: int  # per device: its weight shard plus the batch's KV
    step_ms: float
    tokens_per_s: float
    fits: bool  # the batch's KV fits in the pool


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    model: str
    device: Accelerator
    tensor_parallel_size: int
    expert_parallel: bool  # a MoE model's experts placed whole on devices, num_experts / tensor_parallel_size each
    dtype: str
    quantization: str | None  # the decoder projections' (None: in dtype; AS_STORED: a GGUF file's tensors as stored;
    # FP8_AS_STORED: an fp8 checkpoint's projections)
    quantize_lm_head: bool  # the LM head (a tied model's embedding) quantized as the projections
    kv_cache_dtype: str
    max_model_len: int
    block_size: int
    gpu_memory_utilization: float
    weight_bytes_per_device: int
    expert_bytes_per_device: int  # of weight_bytes_per_device, the experts' (0: a dense model)
    parameters: int  # the whole model's
    active_parameters: int  # those one token's forward uses (a MoE model: only its top-k experts)
    kv_heads_per_device: int
    kv_head_replicas: int  # devices holding each KV head (1: no replication)
    kv_bytes_per_token_per_device: int
    kv_replication_bytes_per_token: int  # per device, over what an even split of the heads would take
    num_kv_blocks: int  # per device, the null block included
    max_concurrent_tokens: int
    max_concurrent_seqs: int  # of max_model_len tokens each
    context_len: int
    roofline: tuple[RooflinePoint, ...]


def load_model_config(config_or_preset: str) -> tuple[str, ModelConfig]:
    """A preset name, a config.json file, a directory holding one or a GGUF file (its config from its metadata)
    -> (a name for it, the config)."""
    preset = PRESETS_DIR / f"{config_or_preset}.json"
    path = Path(config_or_preset)
    if path.suffix == ".gguf" and path.is_file():
        from cbjax.checkpoint.gguf_import import gguf_config  # the gguf package: only a GGUF file needs it

        return config_or_preset, ModelConfig.from_hf_config(gguf_config(path))
    if preset.is_file():
        path = preset
    elif path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
        raise ValueError(f"{config_or_preset!r} is neither a preset ({presets}) nor a config.json file, a directory "
                         f"holding one or a .gguf file")
    return config_or_preset, ModelConfig.from_hf_config(json.loads(path.read_text()))


def layer_repeats(config: ModelConfig) -> tuple[int, ...]:
    """How many of the model's layers each layer of its representative model stands for: the dense
    layers, then (a mixture-of-experts model) the sparse ones."""
    num_sparse = len(config.sparse_layers)
    return (config.num_hidden_layers - num_sparse, num_sparse) if num_sparse else (config.num_hidden_layers,)


def representative_model(
    config: ModelConfig, dtype: jnp.dtype, quantization: str | None = None, quantize_lm_head: bool = False,
) -> nnx.Module:
    """The abstract model with one layer of each kind: dense, then (a MoE model) sparse; its projections (and
    with quantize_lm_head its LM head) declared as `quantization` stores them (declare_quantized: int8 with
    scales, or nibbles with scales and mins)."""
    kinds = dataclasses.replace(config, num_hidden_layers=len(layer_repeats(config)),
                                sparse_layers=(1,) if config.sparse_layers else ())
    return nnx.eval_shape(lambda: declare_quantized(model_class(kinds)(kinds, dtype=dtype, rngs=nnx.Rngs(0)), quantization,
                                                    lm_head=quantize_lm_head))


def _parameter_shards(model: nnx.Module, config: ModelConfig, tensor_parallel_size: int, expert_parallel: bool = False):
    """(path, one device's elements of it, itemsize, how many of the model's layers hold it) per parameter of `model`."""
    repeats = layer_repeats(config)
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        count = repeats[path[path.index("layers") + 1]] if "layers" in path else 1
        shard = shard_shape(path, value.shape, config, tensor_parallel_size, expert_parallel)
        yield path, math.prod(shard), value.dtype.itemsize, count


def weight_bytes_per_device(model: nnx.Module, config: ModelConfig, tensor_parallel_size: int, experts_only: bool = False,
                            expert_parallel: bool = False) -> int:
    """Bytes of one device's shard of every parameter (only the experts', if experts_only) of `model`
    (representative_model)."""
    shards = _parameter_shards(model, config, tensor_parallel_size, expert_parallel)
    return sum(size * itemsize * count for path, size, itemsize, count in shards if not experts_only or "experts" in path)


def stored_bytes_per_device(params: dict[str, jax.ShapeDtypeStruct], config: ModelConfig, tensor_parallel_size: int,
                            experts_only: bool = False, expert_parallel: bool = False) -> int:
    """weight_bytes_per_device of the whole model's parameters by name, as a file stores them
    (gguf_params.gguf_stored_shapes), not of a representative model."""
    return sum(
        math.prod(shard_shape(tuple(name.split(".")), spec.shape, config, tensor_parallel_size, expert_parallel))
        * jnp.dtype(spec.dtype).itemsize
        for name, spec in params.items() if not experts_only or ".experts." in name
    )


def parameter_counts(model: nnx.Module, config: ModelConfig) -> tuple[int, int]:
    """(all parameters, those one token uses: of the experts only top_k of num_experts)."""
    total = active = 0
    for path, size, _, count in _parameter_shards(model, config, 1):
        total += size * count
        active += size * count * (config.num_experts_per_tok / config.num_experts if "experts" in path else 1)
    return total, round(active)


def expected_experts_read(config: ModelConfig, batch_size: int) -> float:
    """The fraction of each sparse layer's experts a decode step of batch_size tokens reads, under uniform routing."""
    return 1 - (1 - config.num_experts_per_tok / config.num_experts) ** batch_size if config.num_experts else 1.0


class _PlannedDevice:
    """What plan_num_blocks reads of a device: its memory, with the weights already in use."""

    platform = "gpu"

    def __init__(self, memory_bytes: int, bytes_in_use: int):
        self._stats = {"bytes_limit": memory_bytes, "bytes_in_use": bytes_in_use}

    def memory_stats(self) -> dict[str, int]:
        return self._stats


def plan_capacity(
    name: str,
    config: ModelConfig,
    device: Accelerator,
    tensor_parallel_size: int = 1,
    *,
    max_model_len: int | None = None,
    dtype: str = "auto",
    kv_cache_dtype_name: str = "auto",
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    context_len: int | None = None,
    expert_parallel: bool = False,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    gguf: str | Path | None = None,
    fp8: str | Path | None = None,
) -> CapacityPlan:
    """The plan for serving `config` on `tensor_parallel_size` devices (a MoE model's experts split within each
    expert, or placed whole with expert_parallel), its decoder projections quantized as `quantization` says
    (the weights' bytes are those it stores; parameters are counted unquantized), with quantize_lm_head its LM head
    (a tied model's embedding) too, or (`gguf`, the file `config` came from) as that file is served as stored:
    its quantized tensors as the engine keeps them, the rest in dtype, or (`fp8`, the fp8 checkpoint `config` came
    from) as it is served as stored: its decoder projections e4m3 with their scales, the rest in dtype; ValueError
    if it cannot run."""
    check_tensor_parallel(config, tensor_parallel_size, expert_parallel)
    check_quantized_lm_head(quantize_lm_head, quantization, tensor_parallel_size)
    if gguf is not None:
        from cbjax.checkpoint.gguf_params import check_as_stored, gguf_stored_shapes  # the gguf package

        check_as_stored(Path(gguf), quantization)
    if fp8 is not None and quantization is not None:
        raise ValueError(f"{name} holds fp8 weights, served as stored; quantization={quantization!r} would round them "
                         "a second time: drop --quantization")
    engine_config = EngineConfig(
        model=name, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype_name,
        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size, quantization=quantization,
    )
    engine_config.resolve(config.max_position_embeddings)
    max_model_len = engine_config.max_model_len
    weight_dtype = jnp.bfloat16 if dtype == "auto" else jnp.dtype(dtype)  # "auto" is bfloat16 off CPU
    float_model = representative_model(config, weight_dtype)  # parameters are counted unquantized
    parameters, active_parameters = parameter_counts(float_model, config)
    model = float_model if quantization is None else representative_model(config, weight_dtype, quantization, quantize_lm_head)
    if gguf is None and fp8 is None:
        check_whole_groups(named_arrays(nnx.state(model)), config, tensor_parallel_size)

        def weights_at(n: int, experts_only: bool = False) -> int:
            return weight_bytes_per_device(model, config, n, experts_only, expert_parallel)
    else:  # the file's tensor list read once per form: under tensor parallelism a GGUF's embedding and head dequantized
        if gguf is not None:
            stored = functools.cache(lambda parallel: gguf_stored_shapes(gguf, config, weight_dtype, parallel))
        else:
            from cbjax.checkpoint.fp8_params import fp8_stored_shapes

            fp8_shapes = fp8_stored_shapes(fp8, config, weight_dtype)  # one form at any tensor parallel size
            stored = lambda parallel: fp8_shapes  # noqa: E731
        check_whole_groups(stored(tensor_parallel_size > 1), config, tensor_parallel_size)

        def weights_at(n: int, experts_only: bool = False) -> int:
            return stored_bytes_per_device(stored(n > 1), config, n, experts_only, expert_parallel)
    weights = weights_at(tensor_parallel_size)
    expert_bytes = weights_at(tensor_parallel_size, experts_only=True)
    usable = int(device.memory_bytes * gpu_memory_utilization)
    if weights >= usable:
        fitting = [n for n in valid_tensor_parallel_sizes(config, expert_parallel) if weights_at(n) < usable]
        fix = f"use tensor_parallel_size={fitting[0]}, " if fitting else "no valid tensor_parallel_size fits; use "
        raise ValueError(
            f"the weights take {weights / 2**30:.1f} GiB per device at tensor_parallel_size={tensor_parallel_size}; "
            f"one {device.name} gives {usable / 2**30:.1f} GiB at gpu_memory_utilization={gpu_memory_utilization}; "
            f"{fix}a smaller dtype or a larger device"
        )
    pool_dtype = kv_cache_dtype(kv_cache_dtype_name, model)
    heads = kv_heads_per_device(config.num_key_value_heads, tensor_parallel_size)
    device_config = dataclasses.replace(config, num_key_value_heads=heads)
    bytes_per_block = kv_cache_bytes_per_block(device_config, block_size, pool_dtype)
    kv_per_token = bytes_per_block // block_size
    even_split = kv_per_token * config.num_key_value_heads / (heads * tensor_parallel_size)
    num_blocks = plan_num_blocks(
        bytes_per_block=bytes_per_block, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=engine_config.max_num_seqs, num_kv_blocks=None, kv_cache_memory_bytes=None,
        gpu_memory_utilization=gpu_memory_utilization, device=_PlannedDevice(device.memory_bytes, weights),
    )
    max_tokens = (num_blocks - 1) * block_size
    context_len = context_len or max_model_len
    return CapacityPlan(
        model=name,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        expert_parallel=expert_parallel,
        dtype=jnp.dtype(weight_dtype).name,
        quantization=AS_STORED if gguf is not None else FP8_AS_STORED if fp8 is not None else quantization,
        quantize_lm_head=quantize_lm_head,
        kv_cache_dtype=jnp.dtype(pool_dtype).name,
        max_model_len=max_model_len,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes_per_device=weights,
        expert_bytes_per_device=expert_bytes,
        parameters=parameters,
        active_parameters=active_parameters,
        kv_heads_per_device=heads,
        kv_head_replicas=heads * tensor_parallel_size // config.num_key_value_heads,
        kv_bytes_per_token_per_device=kv_per_token,
        kv_replication_bytes_per_token=round(kv_per_token - even_split),
        num_kv_blocks=num_blocks,
        max_concurrent_tokens=max_tokens,
        max_concurrent_seqs=(num_blocks - 1) // -(-max_model_len // block_size),
        context_len=context_len,
        roofline=tuple(
            decode_roofline(
                b, round(weights - expert_bytes * (1 - expected_experts_read(config, b))), kv_per_token, context_len,
                device.bandwidth_bytes_per_s,
                fits=b * -(-context_len // block_size) <= num_blocks - 1,
            )
            for b in ROOFLINE_BATCH_SIZES
        ),
    )


def decode_roofline(
    batch_size: int, weight_bytes: int, kv_bytes_per_token: int, context_len: int, bandwidth: float, fits: bool
) -> RooflinePoint:
    """A memory-bound decode step: every device reads the weights it uses (of a MoE model, the experts the
    batch routes to) and the batch's KV once."""
    bytes_read = weight_bytes + batch_size * context_len * kv_bytes_per_token
    step_s = bytes_read / bandwidth
    return RooflinePoint(batch_size, bytes_read, step_s * 1e3, batch_size / step_s, fits)


def format_plan(plan: CapacityPlan) -> str:
    """The plan as the text `cbjax plan` prints."""
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    device, n = plan.device, plan.tensor_parallel_size
    if plan.quantization == AS_STORED:
        quantized = " (the GGUF file's quantized tensors as stored)"
    elif plan.quantization == FP8_AS_STORED:
        quantized = " (the checkpoint's fp8 decoder projections as stored, a byte a weight)"
    elif plan.quantization:
        quantized = f" (decoder projections{' and LM head' if plan.quantize_lm_head else ''} {plan.quantization})"
    else:
        quantized = ""
    lines = [
        f"{plan.model} on {n} x {device.description} ({gib(device.memory_bytes)}, "
        f"{device.bandwidth_bytes_per_s / 1e12:.3g} TB/s each), weights {plan.dtype}{quantized}, "
        f"KV cache {plan.kv_cache_dtype}",
        f"parameters:                    {plan.parameters / 1e9:.2f} B"
        + (f", {plan.active_parameters / 1e9:.2f} B active per token" if plan.active_parameters != plan.parameters else ""),
        f"weights per device:            {gib(plan.weight_bytes_per_device)} ({plan.weight_bytes_per_device:,} bytes)"
        + (f", experts {gib(plan.expert_bytes_per_device)}" if plan.expert_bytes_per_device else "")
        + (" (expert parallel: whole experts, num_experts / N per device)" if plan.expert_parallel else ""),
        f"KV heads per device:           {plan.kv_heads_per_device}",
    ]
    if plan.kv_head_replicas > 1:
        lines.append(
            f"KV heads replicated:           each KV head is held by {plan.kv_head_replicas} devices (fewer KV heads "
            f"than devices); it costs {plan.kv_replication_bytes_per_token:,} bytes per token per device"
        )
    usable = int(device.memory_bytes * plan.gpu_memory_utilization)
    lines += [
        f"KV cache per token per device: {plan.kv_bytes_per_token_per_device:,} bytes",
        f"KV pool per device:            {gib(usable - plan.weight_bytes_per_device)} of {gib(usable)} "
        f"(gpu_memory_utilization={plan.gpu_memory_utilization}) after the weights; step activations not counted "
        f"(the engine measures them at start-up)",
        f"KV blocks:                     {plan.num_kv_blocks - 1:,} of {plan.block_size} tokens (+ the null block)",
        f"most concurrent tokens:        {plan.max_concurrent_tokens:,}",
        f"most concurrent sequences:     {plan.max_concurrent_seqs:,} of max_model_len={plan.max_model_len}",
        "",
        f"decode roofline: per step each device reads its weights (of experts, those the batch is expected to route "
        f"to) and the batch's KV at context length "
        f"{plan.context_len}, at {device.bandwidth_bytes_per_s / 1e12:.3g} TB/s (memory-bound; no compute, "
        f"all-reduce or host time)",
        f"{'batch':>6} {'GiB read/device':>15} {'step ms':>8} {'tokens/s':>10}",
    ]
    for point in plan.roofline:
        note = "" if point.fits else "  (KV does not fit)"
        lines.append(
            f"{point.batch_size:>6} {point.bytes_read / 2**30:>15.2f} {point.step_ms:>8.2f} {point.tokens_per_s:>10,.0f}{note}"
        )
    return "\n".join(lines)
