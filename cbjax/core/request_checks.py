"""Whether an engine can serve a request: one pure function over the engine's limits (no JAX).

The engine core applies it when a request arrives, and so can its front end before sending the
request anywhere (the limits come in the engine-core process's "ready" message): a server
rejects bad input with a 400 before it opens a stream, in either core mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbjax.arguments import check_int
from cbjax.core.sched.policy import SCHEDULING_POLICIES


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the engine's config, its model and its runner."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_suppressed_ids: int  # stop and eos token ids a row holds back under min_tokens (the runner's)
    scheduling_policy: str  # its rule says which priorities a request may have


def check_request(
    limits: RequestLimits, prompt_token_ids: Sequence[int], params: Any, eos_token_ids: Sequence[int], priority: int
) -> None:
    """Raise ValueError, saying what to change, for a request the engine cannot serve (params are
    a SamplingParams, valid on their own already: this checks them against the engine)."""
    check_int("priority", priority)
    SCHEDULING_POLICIES[limits.scheduling_policy].check_priority(priority)
    max_model_len, vocab = limits.max_model_len, limits.vocab_size
    num_prompt = len(prompt_token_ids)
    if not prompt_token_ids:
        raise ValueError("the prompt is empty (0 tokens); give at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); use ids from this model's tokenizer"
        )
    if num_prompt >= max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt} tokens; max_model_len is {max_model_len} "
            "(prompt plus at least one output token); raise max_model_len or shorten the prompt"
        )
    if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt} tokens and max_tokens={params.max_tokens}, "
            f"{num_prompt + params.max_tokens} in all; max_model_len is {max_model_len}; "
            "lower max_tokens, shorten the prompt or raise max_model_len"
        )
    params.check_token_ids(vocab)  # stop_token_ids, logit_bias, allowed_token_ids, bad_words
    suppressed = len(params.stop_token_ids) + (0 if params.ignore_eos else len(eos_token_ids))
    if params.min_tokens > 0 and suppressed > limits.max_suppressed_ids:
        raise ValueError(
            f"min_tokens={params.min_tokens} would hold back {suppressed} stop and eos token ids; "
            f"at most {limits.max_suppressed_ids} are supported; pass fewer stop_token_ids or min_tokens=0"
        )
    if params.structured_outputs is not None:
        # Imported by the first constrained request: llguidance and numpy stay out of `import cbjax`.
        from cbjax.core.structured.guidance import check_constraint

        check_constraint(params.structured_outputs)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise ValueError(
                f"{name}={value} exceeds max_logprobs={limits.max_logprobs}; ask for fewer or raise max_logprobs"
            )
