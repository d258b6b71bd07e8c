"""What the engine returns for a request: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """Log-probability of one candidate token (from the raw logits), its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per output token, when asked for
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Times are time.monotonic() seconds; the latencies are named as vLLM names them, None until known."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_generation_tokens: int = 0  # output tokens so far

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to first being scheduled."""
        return _since(self.arrival_time, self.first_scheduled_time)

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first output token (TTFT)."""
        return _since(self.arrival_time, self.first_token_time)

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to finishing (finished_time - arrival_time)."""
        return _since(self.arrival_time, self.finished_time)


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # None at the first prompt position, then per position {token_id: Logprob} of the top N and the
    # prompt token, when SamplingParams.prompt_logprobs asked for them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (the first completion's)
