"""EngineConfig: every engine option in one dataclass, validated once (vLLM's names)."""

from __future__ import annotations

import dataclasses
import os

from cbjax.arguments import ArgumentTypeError, check_int, check_number, describe
from cbjax.core.kv.prefix_cache import check_hash_algo
from cbjax.core.sched.policy import check_scheduling_policy
from cbjax.core.structured.reasoning import check_reasoning_parser
from cbjax.core.spec.config import SpeculativeConfig
from cbjax.quantization import check_quantization

# The KV pool dtypes (vLLM's names); "fp8" and "fp8_e4m3" are both float8 e4m3fn (worker/model_runner.kv_cache_dtype).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3")


@dataclasses.dataclass
class EngineConfig:
    """What `LLM(...)` and `LLMEngine(...)` take; defaults serve a small model on a laptop."""

    model: str
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # "auto": float32 on CPU (XLA:CPU's fastest), bfloat16 on GPU
    # The KV pool's dtype: "auto" (the activation dtype), "float32", "bfloat16", "float16" (halves float32's bytes), or
    # "fp8" (vLLM's alias "fp8_e4m3"): e4m3 pages, half float16's bytes, at the per-layer scales the checkpoint
    # carries, else 1.0, unless calculate_kv_scales (docs/caching.md, "fp8 KV cache").
    kv_cache_dtype: str = "auto"
    # With an fp8 kv_cache_dtype (vLLM's option): each layer's k_scale and v_scale computed at start-up from a
    # calibration step, max |K| / 200 and max |V| / 100 (worker/kv_scales.py), instead of 1.0: for models whose
    # K or V reach past e4m3's 448 (large K biases, outlier channels), which 1.0 would clip, or stay so small
    # that e4m3's subnormals round them.
    calculate_kv_scales: bool = False
    # Weight-only quantization at load (vLLM's keyword): "int8" (symmetric, per output channel) or "int4"
    # (groups of 128 inputs per output channel, symmetric or asymmetric per group; "int4-g64"/"int4-g32" for
    # widths 128 does not divide) for every decoder projection;
    # embeddings and the LM head stay float, and so do the checkpoint and its weights cache. On a CPU with
    # cpu_packed_weights the weights are packed for the C++ int8 / 4-bit matmul. None: off.
    quantization: str | None = None
    # With `quantization`: the LM head quantized with the same scheme too (int8 per vocabulary row, int4 in groups
    # along the hidden size; a tied model's embedding is that head's kernel, gathered row by row). Off by default:
    # the head's error lands on every logit. Not under tensor parallelism.
    quantize_lm_head: bool = False
    max_num_seqs: int = 64
    max_model_len: int | None = None  # defaults to min(model's max_position_embeddings, 2048)
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size (null block included)
    kv_cache_memory_bytes: int | None = None  # or a byte budget for the pool
    gpu_memory_utilization: float | None = None  # or a fraction of device memory (GPU; None = 0.9)
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None  # defaults to 512 chunked, else max_model_len
    # Most requests that compute a prompt chunk (2+ tokens) in one step; the others' chunks wait a
    # step. It bounds the query tiles of the jnp attention, so decodes beside a chunk cost less.
    max_num_prefills: int = 8
    # Who is admitted next and preempted first (vLLM's names): "fcfs" (arrival order) or "priority"
    # (each request's `priority`, lower first, ties by arrival; the largest value is preempted first).
    scheduling_policy: str = "fcfs"
    # Prompt-step buckets also at 1.5x each power of two from 64 tokens (96, 192, 384 at 512): a
    # prompt step pads at most a third of its rows, for 3 more compiled steps at start-up
    # (`cbjax serve`'s default: True).
    prompt_bucket_midpoints: bool = False
    attention_backend: str = "auto"  # "auto" | "cpp" | "xla" | "pallas" | "pallas_interpret"
    # On a CPU with the C++ kernels (attention_backend "auto" or "cpp"), one device: float32 (or
    # quantized int8/int4) projection weights packed in 32-column panels at load and multiplied by the C++ matmul
    # kernel, 1.3-1.55x faster than XLA:CPU's dots at decode steps' 8-64 rows; bfloat16 ones (a tied LM head
    # too) where the CPU has AMX tiles, XLA's dots elsewhere (the start-up log says which). False: XLA's dots.
    cpu_packed_weights: bool = True
    seed: int = 0  # seeds requests that bring no seed of their own
    max_logprobs: int = 20
    # Persistent XLA compilation cache: "auto" = under cache_dir() (one folder per jax version and
    # machine), a folder, or None = off (as is CBJAX_DISABLE_COMPILE_CACHE=1).
    compilation_cache_dir: str | None = "auto"
    enable_prefix_caching: bool = True  # reuse the KV of cached full blocks of earlier prompts (vLLM V1's default)
    # The prefix cache's block hash (vLLM's option): "sha256", collision-resistant, so no prompt can be built to
    # read another request's cached KV; or "builtin", Python's 64-bit hash: less host time per step, for one
    # tenant only (BENCHMARKS.md, "Prefix-cache block hash").
    prefix_caching_hash_algo: str = "sha256"
    # Schedule and launch step N+1 before reading step N's tokens (vLLM's async_scheduling): the
    # host's work of a step overlaps the device's. False: one step at a time. None ("auto",
    # `cbjax serve`'s default): on an accelerator always, on a CPU only while every seat is taken
    # (LLMEngine._overlaps: otherwise a prompt arriving mid-step would wait one more step).
    async_scheduling: bool | None = True
    # The model's thinking markers (vLLM's option; `cbjax serve --reasoning-parser` sets it): "deepseek_r1" or
    # "qwen3". A constrained request's grammar then applies from after the reply's </think>, not to the thinking.
    reasoning_parser: str | None = None
    # Speculative decoding (vLLM's option and names; docs/serving.md): {"method": "ngram" | "suffix" |
    # "draft_model", "num_speculative_tokens": k, "prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_*",
    # "model" (draft_model: the draft's directory), "disable_by_batch_size"}, a dict or its JSON. Greedy output is token for token the same; requests with
    # penalties, logprobs, bad_words, structured outputs or under min_tokens do not speculate. None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None
    tensor_parallel_size: int = 1  # devices the weights, heads and KV pool are split over (one "model" mesh axis)
    # Mixture-of-experts (vLLM's option): the experts placed whole on the tensor_parallel_size devices,
    # num_experts / tensor_parallel_size each, instead of each expert split over all; attention stays tensor parallel.
    enable_expert_parallel: bool = False
    # Multi-host (worker/distributed/multihost.py): every process gets the same options but its own process_id;
    # process 0 serves, the others run `cbjax worker`. The mesh spans all processes' devices.
    coordinator: str | None = None  # "HOST:PORT" of process 0, where jax.distributed's coordinator listens
    num_processes: int = 1
    process_id: int = 0
    # LoRA adapters (vLLM's names; cbjax/lora/): requests may name a PEFT adapter (LoRARequest), applied
    # inside the same compiled steps as the base model's rows. max_loras: adapters resident on the device at
    # once (a step mixes at most this many); max_lora_rank: the largest rank an adapter may have (the slots'
    # width); max_cpu_loras: adapters kept read on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("int", "int | None") and value is not None:
                check_int(field.name, value)
            elif field.type == "float | None" and value is not None:
                check_number(field.name, value)
            elif field.type in ("str", "str | None") and isinstance(value, os.PathLike):
                setattr(self, field.name, os.fspath(value))
            elif field.type in ("str", "str | None") and value is not None and not isinstance(value, str):
                raise ArgumentTypeError(f"{field.name} must be a str, got {describe(value)}")
        positive = ("max_num_seqs", "block_size", "max_logprobs", "max_num_prefills", "tensor_parallel_size", "num_processes",
                    "max_loras", "max_lora_rank")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
        if self.calculate_kv_scales and self.kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            raise ValueError(f"calculate_kv_scales=True computes the scales of an fp8 KV cache, but kv_cache_dtype="
                             f"{self.kv_cache_dtype!r}; set kv_cache_dtype='fp8' or drop calculate_kv_scales")
        check_scheduling_policy(self.scheduling_policy)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        check_quantization(self.quantization)
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head=True quantizes the LM head with `quantization`'s scheme, but quantization is "
                             "None; set quantization (e.g. 'int8') or drop quantize_lm_head")
        check_hash_algo(self.prefix_caching_hash_algo)
        check_reasoning_parser(self.reasoning_parser)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (the GPU kernels tile by it), got {self.block_size}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.enable_lora and self.num_processes > 1:
            raise ValueError(f"enable_lora is not supported with num_processes={self.num_processes} (multi-host): "
                             "adapter slots are written by the serving process alone; serve LoRA from one process")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} is below max_loras={self.max_loras}: every adapter on the "
                             "device is kept on the host too; raise max_cpu_loras or leave it None (= max_loras)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}")

    def resolve(self, max_position_embeddings: int) -> None:
        """Fill the defaults that depend on the model, then check the limits against each other."""
        if self.max_model_len is None:
            self.max_model_len = min(max_position_embeddings, 2048)
        if self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{max_position_embeddings}; lower max_model_len"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 512 if self.enable_chunked_prefill else self.max_model_len
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len="
                f"{self.max_model_len} with enable_chunked_prefill=False, so a long prompt could never run; "
                "raise max_num_batched_tokens, lower max_model_len or enable chunked prefill"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                f"{self.max_num_seqs}; every running request needs a token per step; raise it"
            )
