"""One request's state as the scheduler sees it: its tokens, progress, blocks and status."""

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks freed; back at the head of the waiting queue
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        # The finished statuses are the last ones; an int compare, not an enum hash (asked of every request every step).
        return self._value_ >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason: "stop" | "length" | "abort", or None while unfinished."""
        return _FINISH_REASONS.get(self._value_)  # by value: an enum member's hash is computed in Python


_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED._value_  # the finished statuses are this one and after
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED.value: "stop",
    RequestStatus.FINISHED_LENGTH.value: "length",
    RequestStatus.FINISHED_ABORTED.value: "abort",
}


@dataclass(eq=False, slots=True)  # slots: its fields are read and written for every row of every step
class Request:
    """A prompt and what has been generated for it.

    `sampling_params` is duck-typed: the scheduler reads `max_tokens` (None = up to
    max_model_len), `min_tokens`, `stop_token_ids` and `ignore_eos`.
    Output tokens are added only through `append_output_token` (or the scheduler's update,
    which does the same inline), which keeps `all_token_ids` (prompt + output) in step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # the priority policy serves lower values first (vLLM's rule); fcfs ignores it
    lora_request: Any = None  # the LoRA adapter it runs under (cbjax.lora.LoRARequest); None: the base model

    output_token_ids: list[int] = field(init=False, default_factory=list)
    all_token_ids: list[int] = field(init=False)
    # KV entries written, or being written by a launched step, for the first num_computed_tokens
    # tokens (advanced when a step is scheduled); reset to 0 on preemption.
    num_computed_tokens: int = field(init=False, default=0)
    # Tokens sampled by launched steps whose results the host has not read yet (vLLM's
    # num_output_placeholders): at most one, or two while the next step is scheduled.
    num_output_placeholders: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    block_ids: list[int] = field(init=False, default_factory=list)
    # Its leading blocks the block manager has registered in the prefix cache (0 when it holds none).
    num_registered_blocks: int = field(init=False, default=0)
    # Chained hashes of the full blocks of all_token_ids (prefix caching), grown as tokens arrive.
    block_hashes: list[bytes | int] = field(init=False, default_factory=list)  # (prefix_cache.BlockHash)
    # Set by the scheduler when the request is added: the token count at which it stops for
    # length (max_model_len, or prompt plus max_tokens), and the ids that may stop it when
    # sampled (eos unless ignore_eos, stop_token_ids): asked of every request every step.
    max_num_tokens: int = field(init=False, default=0)
    stop_check_ids: frozenset[int] = field(init=False, default=frozenset())
    # Prompt tokens found in the prefix cache at first admission (vLLM's num_cached_tokens).
    num_cached_tokens: int = field(init=False, default=0)
    num_preemptions: int = field(init=False, default=0)
    # The stop token id, or the stop string the engine matched.
    stop_reason: int | str | None = field(init=False, default=None)
    # Its structured-output constraint's state (core/structured/backend.py's Grammar), set once compiled;
    # the runner fills the row's token mask from it.
    grammar: Any = field(init=False, default=None)
    # Draft tokens to verify in its next step (speculative decoding; core/spec/speculation.py), proposed
    # after its newest token arrived; the scheduler takes them, the step's verification decides.
    spec_token_ids: list[int] = field(init=False, default_factory=list)
    first_scheduled_time: float | None = field(init=False, default=None)
    first_token_time: float | None = field(init=False, default=None)
    finished_time: float | None = field(init=False, default=None)

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = list(self.eos_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        # RequestStatus.is_finished without a second property call: asked several times a step of every request.
        return self.status._value_ >= _FIRST_FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first `num_output_tokens` output tokens: a stop string ended the request inside a
        verified run of several tokens (speculative decoding), so the ones after it never were."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
