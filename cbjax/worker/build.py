"""The device side of an engine, made from its config: the model loaded, the KV pool sized, the runner compiled.

LLMEngine (engine/), the engine-core process (core/engine_core_proc.py) and a multi-host worker
(distributed/multihost.py) call this; the front ends import it only when they build one, so that
importing them imports no JAX.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import jax
from flax import nnx

from cbjax.checkpoint.loader import load_model
from cbjax.checkpoint.params import named_arrays
from cbjax.checkpoint.resolve import resolve_model
from cbjax.config import EngineConfig
from cbjax.core.kv.sizing import plan_num_blocks
from cbjax.models.config import ModelConfig
from cbjax.models.layers.attention import AttentionPlan, resolve_backend
from cbjax.models.layers.linear import float_equivalent_bytes
from cbjax.models.layers.lora import attach_lora
from cbjax.models.registry import kv_cache_bytes_per_block
from cbjax.tokenizer.tokenizer import Tokenizer
from cbjax.worker.compilation.compile_cache import enable_compile_cache
from cbjax.worker.distributed import multihost
from cbjax.worker.distributed.sharding import TensorParallel
from cbjax.worker.kv_scales import calibrate_kv_scales, use_checkpoint_kv_scales
from cbjax.worker.model_runner import ModelRunner, kv_cache_dtype
from cbjax.worker.spec.draft_model import DraftModelProposer
from cbjax.worker.spec.drafter import Drafter
from cbjax.worker.sample.penalty_state import penalty_state_bytes
from kernels_cpu import bf16_matmul_path, kernel_problem, register_in_background

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Worker:
    runner: ModelRunner
    model_config: ModelConfig
    platform: str  # the first device's: "cpu", "gpu", ...
    step_broadcast: multihost.StepBroadcast | None  # multi-host: the per-step buffer's ends (None: one process)
    drafter: Drafter | DraftModelProposer | None = None  # speculative decoding's proposer (None: speculative_config off)


def make_drafter(config: EngineConfig, target_vocab_size: int, *, dtype: str,
                 activation_dtype: str | None) -> Drafter | DraftModelProposer | None:
    """speculative_config's proposer (None: off)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        return DraftModelProposer(spec, config, target_vocab_size, dtype=dtype, activation_dtype=activation_dtype)
    return Drafter(spec)


def packs_float_weights(dtype: str) -> bool:
    """Whether float `dtype` weights go to the packed C++ matmul on this CPU: float32 always; bfloat16 where the
    kernel multiplies them on AMX tiles, waiting for the kernels' build to ask it. Its vdpbf16ps path, what a CPU
    without AMX runs, gave 0.58-0.82x the output tokens/s of XLA:CPU's own bf16 dots in whole engines
    (`python -m benchmarks.bf16_paths`), so there bf16 weights keep XLA's dots."""
    if dtype != "bfloat16":
        return True
    path = bf16_matmul_path() if kernel_problem() is None else "none (the kernels did not build)"
    logger.info("bfloat16 weights: %s", "packed for the C++ matmul on AMX tiles" if path == "amx" else
                f"XLA:CPU's dots (the C++ matmul's bf16 path here is {path}, not AMX tiles)")
    return path == "amx"


def build_worker(config: EngineConfig, *, precompile: bool = True, progress: bool = True) -> Worker:
    """Load `config.model`, size the KV pool and make (and compile, unless precompile=False) the runner.

    Resolves `config` in place: the model's path, and max_model_len and the other limits the model sets.
    """
    config.model = str(resolve_model(config.model))
    multihost.initialize(config)  # before any device is touched
    device = jax.devices()[0]
    enable_compile_cache(config.compilation_cache_dir, device)
    dtype = config.dtype if config.dtype != "auto" else ("float32" if device.platform == "cpu" else "bfloat16")
    # XLA:CPU has fast bf16 x bf16 -> f32 dots but slow bf16 arithmetic otherwise: on CPU,
    # 16-bit weights keep float32 activations and a float32 KV pool.
    activation_dtype = "float32" if device.platform == "cpu" else None
    tensor_parallel = None
    if config.tensor_parallel_size > 1:  # checked against the model before any weight is read
        tensor_parallel = TensorParallel.create(ModelConfig.from_dir(config.model), config.tensor_parallel_size,
                                                expert_parallel=config.enable_expert_parallel)
    # On a CPU the C++ attention kernel may need building (seconds): it builds while the weights
    # load and the steps are traced; the runner waits for it before it compiles them.
    kernel_build = register_in_background() if device.platform == "cpu" and config.attention_backend in ("auto", "cpp") else None
    # Under TP, model_config counts KV heads after repetition (see cbjax/worker/distributed/sharding.py).
    # Float32 projections are packed as float32 panels, int8 ones (quantization="int8") as int8 panels.
    pack_for_cpu = (kernel_build is not None and config.cpu_packed_weights and tensor_parallel is None
                    and config.num_processes == 1)
    if config.quantization is not None and device.platform == "cpu" and not pack_for_cpu:
        warnings.warn(
            f"quantization={config.quantization!r} on a CPU without the packed C++ matmul (cpu_packed_weights=False, "
            "tensor_parallel_size > 1, several processes or attention_backend other than 'auto'/'cpp') runs slower "
            "than float32: XLA:CPU converts the int8 weights before each dot (benchmarks/quantization.py); it saves "
            "memory, not time. Keep the defaults on one device for int8's speed.", RuntimeWarning, stacklevel=2)
    # One device: q/k/v and gate/up as one kernel each (3 dots and 3 arrays fewer per layer).
    model, mc = load_model(
        config.model, dtype=dtype, activation_dtype=activation_dtype, tensor_parallel=tensor_parallel,
        pack_for_cpu=pack_for_cpu, fused_projections=tensor_parallel is None, quantization=config.quantization,
        quantize_lm_head=config.quantize_lm_head, pack_floats=not pack_for_cpu or packs_float_weights(dtype),
    )
    config.resolve(mc.max_position_embeddings)
    if config.max_logprobs > mc.vocab_size:  # a step's top-k cannot return more than the vocabulary
        logger.info("max_logprobs=%d is more than the vocabulary: %d", config.max_logprobs, mc.vocab_size)
        config.max_logprobs = mc.vocab_size
    if config.enable_lora and tensor_parallel is not None and tensor_parallel.kv_repeats > 1:
        raise ValueError(f"enable_lora with tensor_parallel_size={config.tensor_parallel_size} above the model's "
                         f"{mc.num_key_value_heads // tensor_parallel.kv_repeats} KV heads is not supported (the k/v "
                         "adapters would need their heads repeated too); use a tensor_parallel_size up to the KV heads")
    backend = resolve_backend(
        config.attention_backend,
        num_q_heads=mc.num_attention_heads // config.tensor_parallel_size,  # one device's heads
        num_kv_heads=mc.num_key_value_heads // config.tensor_parallel_size,
        head_dim=mc.head_dim,
        block_size=config.block_size,
        wait_for_kernel=kernel_build is None,
    )
    use_checkpoint_kv_scales(model, config.model, config.kv_cache_dtype, config.calculate_kv_scales)
    if config.calculate_kv_scales:  # before the LoRA slots: the calibration step runs the base model alone
        mesh = None if tensor_parallel is None else tensor_parallel.mesh
        # The C++ kernel's build is waited for here (the runner falls back to "xla" where it failed, and so does this).
        calibration = "xla" if backend == "cpp" and kernel_problem() is not None else backend
        calibrate_kv_scales(model, Tokenizer.from_dir(config.tokenizer or config.model), config.block_size,
                            AttentionPlan(calibration, mesh=mesh, expert_parallel=config.enable_expert_parallel),
                            config.max_model_len)
    if config.enable_lora:  # every projection gets max_loras adapter slots beside the base model's (slot 0)
        attach_lora(model, mc, config.max_loras, config.max_lora_rank)
    # A draft model (speculative_config method "draft_model") is loaded before the pool is sized, so the
    # device memory in use counts its weights and its own small pool.
    drafter = make_drafter(config, mc.vocab_size, dtype=dtype, activation_dtype=activation_dtype)
    reserved_bytes = 0
    if device.platform != "cpu" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        # A profiled step: what the largest steps need besides the pool, measured on a 2-block pool.
        reserved_bytes = ModelRunner(model, mc, config, 2, backend, tensor_parallel).peak_step_bytes()
        # The penalty table is allocated with the runner, after the pool is sized: keep room for it.
        reserved_bytes += penalty_state_bytes(config.max_num_seqs, mc.vocab_size)
    num_blocks = plan_num_blocks(
        # Memory sizing is per device: each holds 1/tensor_parallel_size of every block.
        bytes_per_block=kv_cache_bytes_per_block(mc, config.block_size, kv_cache_dtype(config.kv_cache_dtype, model))
        // config.tensor_parallel_size,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        device=device,
        weights_bytes=float_equivalent_bytes(named_arrays(nnx.state(model)), dtype),  # quantized: the pool of the float model
        reserved_bytes=reserved_bytes,
    )
    runner = ModelRunner(model, mc, config, num_blocks, backend, tensor_parallel)
    step_broadcast = multihost.attach(runner, config)
    if precompile:
        start = time.perf_counter()
        runner.precompile(progress=progress)
        logger.info("compiled %d steps in %.1f s", len(runner.buckets), time.perf_counter() - start)
    if precompile and isinstance(drafter, DraftModelProposer):
        drafter.precompile(progress=progress)
    return Worker(runner, mc, device.platform, step_broadcast, drafter)
