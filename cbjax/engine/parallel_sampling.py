"""Parallel sampling (SamplingParams.n): one prompt, N completions, each a child request.

Child 0 computes the prompt; with prefix caching the other children wait until it has (the
engine core holds them: EngineCore.add_requests), then find the prompt's full blocks in the cache
and share them (reference counts), computing only the partial last block, which each owns. A
request that must compute its whole prompt itself (computes_whole_prompt) is not held back: each
child computes its prompt.
"""

from __future__ import annotations

import dataclasses

from cbjax.core.request import Request
from cbjax.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class ParentRequest:
    """What the caller submitted under one request id: one child per completion, in index order."""

    request_id: str
    children: list[Request]

    @property
    def finished(self) -> bool:
        children = self.children
        if len(children) == 1:  # n=1, nearly every request: asked of it every step
            return children[0].is_finished
        return all(child.is_finished for child in children)


def child_request_ids(request_id: str, n: int) -> list[str]:
    """vLLM's child ids ("{index}_{parent id}"); a single completion keeps the caller's id."""
    return [request_id] if n == 1 else [f"{index}_{request_id}" for index in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` samples alone; a seeded one from seed + index (vLLM's rule), its own stream."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
