"""Which requests speculate, their drafts, and what verification accepted (vLLM's spec_decode counters).

Drafts are proposed on the host after a step's tokens are in their requests, for requests whose
every token is known (none in flight), and only while the running batch is at most
disable_by_batch_size: a larger batch's step costs about as much per token row as it saves. The
scheduler verifies them in the request's next step (1 + k query tokens); the device's rejection
sampler keeps the output exactly the target's.

With adaptive_num_speculative_tokens, a request's drafts are cut to its own limit: one more than its
last verification accepted, growing by one after each verification that accepted every draft, never
above k. On CPU every verified row costs step time (buckets of n * (1 + k) tokens), so drafts past
where the last run broke off are mostly paid for and thrown away.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from cbjax.core.request import Request, RequestStatus
from cbjax.core.spec.config import SpeculativeConfig


_RUNNING = RequestStatus.RUNNING


class Drafter(Protocol):
    """The proposer the worker side builds (worker/spec/drafter.py)."""

    k: int

    def draft(self, requests: list[Request]) -> list[list[int]]:
        """Up to k drafts to follow each request's tokens, together (a draft model runs them as one batch)."""
        ...

    def finish(self, request: Request) -> None: ...


def may_speculate(request: Request) -> bool:
    """Whether verifying drafts is exact for `request` here: its sampling needs no state that changes
    token by token within a step (penalties, bad words, a grammar, min_tokens still holding eos back)
    and it reports no logprobs. The others decode one token a step, which is lossless too."""
    params = request.sampling_params
    return (request.grammar is None and params.structured_outputs is None and params.logprobs is None
            and not params.has_penalties and not params.bad_words_token_ids
            and request.num_output_tokens >= params.min_tokens)


class Speculation:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter):
        self.drafter = drafter
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        # adaptive_num_speculative_tokens: each speculating request's draft limit, by request id (absent: k)
        self.draft_limits: dict[str, int] | None = {} if config.adaptive_num_speculative_tokens else None
        # vLLM's SpecDecodingStats, cumulative
        self.num_drafts = 0  # verified requests with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k

    def is_on(self, num_running: int) -> bool:
        """Speculation on for a step of `num_running` running requests (disable_by_batch_size)."""
        return num_running <= self.disable_by_batch_size

    def propose(self, requests: Iterable[Request]) -> None:
        """Draft for each running request whose tokens are all on the host and that may speculate."""
        speculating = [request for request in requests
                       if request.status is _RUNNING and not request.num_output_placeholders and may_speculate(request)]
        if speculating:
            limits, k = self.draft_limits, self.k
            for request, drafts in zip(speculating, self.drafter.draft(speculating)):
                request.spec_token_ids = drafts if limits is None else drafts[: limits.get(request.request_id, k)]

    def record(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_draft` drafts accepted."""
        if self.draft_limits is not None:
            limit = self.draft_limits.get(request_id, self.k)
            self.draft_limits[request_id] = min(self.k, limit + 1 if num_accepted == num_draft else num_accepted + 1)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    def finish(self, request: Request) -> None:
        self.drafter.finish(request)
        if self.draft_limits is not None:
            self.draft_limits.pop(request.request_id, None)

    def stats(self) -> dict[str, Any]:
        """The counters for get_stats() (and the /metrics counters made from them)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
            # vLLM's mean acceptance length: tokens per verifying step of a request, the bonus counted
            "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / max(1, self.num_drafts),
        }
