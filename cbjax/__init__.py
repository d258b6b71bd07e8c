"""cbjax: continuous batching over a paged KV cache, in JAX, with Pallas attention kernels."""

from cbjax.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from cbjax.engine.config import EngineConfig
from cbjax.llm import LLM
from cbjax.outputs import CompletionOutput, RequestOutput
from cbjax.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
