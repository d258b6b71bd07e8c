"""What one schedule hands the worker: the rows of the step, and the requests preempted or given blocks."""

import functools
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

from cbjax.core.request import Request


class ScheduledRequest(NamedTuple):  # a tuple: hundreds are made every step
    """Compute tokens start ... start + num_new_tokens - 1 of `request` (the last may be a
    placeholder: the token the previous step samples)."""

    request: Request
    num_new_tokens: int
    start: int  # the request's num_computed_tokens before this step
    samples: bool  # after this step every token is computed, so a new one is sampled


_NUM_NEW_TOKENS = operator.attrgetter("num_new_tokens")
# ScheduledRequest((request, ...)) without the Python-level __new__ a NamedTuple has: the same tuple, made in C.
scheduled_request = functools.partial(tuple.__new__, ScheduledRequest)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str]
    # The scheduled requests that got blocks in this schedule (the others' block_ids did not change):
    # what a step that follows the previous one sends of the block tables (persistent_batch.py).
    allocated: list[Request] = field(default_factory=list)
    # The rows' num_new_tokens added up, if the scheduler counted them as it went (else summed when asked).
    num_tokens: int | None = None
    # Draft tokens each speculating row verifies after its newest token, by request id (vLLM's
    # scheduled_spec_decode_tokens); such a row computes 1 + len(drafts) tokens and samples.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @functools.cached_property
    def num_scheduled_tokens(self) -> int:
        return sum(map(_NUM_NEW_TOKENS, self.scheduled)) if self.num_tokens is None else self.num_tokens

    @functools.cached_property
    def is_decode_only(self) -> bool:
        """Every scheduled request adds exactly one token (an empty step is not a decode step)."""
        # Each scheduled request adds at least one token: one each iff as many tokens as requests.
        return bool(self.scheduled) and self.num_scheduled_tokens == len(self.scheduled)
