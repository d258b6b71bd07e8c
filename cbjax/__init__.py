"""cbjax: continuous batching over a paged KV cache, in JAX, with Pallas attention kernels."""

from cbjax.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from cbjax.engine.async_llm import AsyncLLM
from cbjax.config import EngineConfig
from cbjax.entrypoints.llm import LLM
from cbjax.lora.request import LoRARequest
from cbjax.outputs import CompletionOutput, RequestOutput
from cbjax.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
