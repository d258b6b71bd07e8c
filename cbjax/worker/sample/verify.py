"""The sampler's verification of draft tokens (speculative decoding), inside the jitted step.

A speculating request's step computes its newest token and its k drafts; the target's logits at those
1 + k positions go through the same logits and random stages as a sampled token's would (its sampling
row repeated, the counter moved on per position), become per-position target probabilities (one-hot
at the argmax for a greedy row, so it accepts exactly while the drafts are what greedy decoding would
pick), and rejection.py accepts a prefix of the drafts and samples the token after it.

Only rows whose stages hold no per-token state speculate (core/spec/speculation.py's may_speculate),
so repeating the row's columns over its positions is exact. The draft rows are a fixed number R
(compacted, padding rows verify nothing), so the step's shape does not depend on who speculates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from cbjax.worker.sample.penalty_state import PenaltyState
from cbjax.worker.sample.rejection import greedy_rejection_sample, rejection_sample
from cbjax.worker.sample.sampler import SamplingTensors, greedy_tokens, process_logits, random_scaled, row_keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """R draft rows of a step (numpy on the host, arrays in the step); padding rows have num_draft 0."""

    sampling_rows: Int[Array, "R"]  # the request's row in the step's SamplingTensors
    logits_indices: Int[Array, "R K1"]  # token rows of its newest token, then of each draft (padding repeats)
    token_ids: Int[Array, "R K"]  # the drafts
    num_draft: Int[Array, "R"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifiedTokens:
    """Per draft row: the accepted drafts, then the token sampled after them, then rejection.REJECTED."""

    token_ids: Int[Array, "R K1"]
    num_accepted: Int[Array, "R"]


def empty_drafts(num_rows: int, k: int) -> DraftInputs:
    """Host buffers of R=num_rows draft rows that verify nothing."""
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return DraftInputs(zeros(num_rows), zeros(num_rows, k + 1), zeros(num_rows, k), zeros(num_rows))


def empty_verified(num_rows: int, k: int) -> VerifiedTokens:
    return VerifiedTokens(np.zeros((num_rows, k + 1), np.int32), np.zeros(num_rows, np.int32))


def logits_with_drafts(compute_logits, hidden: Float[Array, "T D"], logits_indices: Int[Array, "S"],
                       drafts: DraftInputs) -> tuple[Float[Array, "S V"], Float[Array, "RK1 V"]]:
    """The sampling rows' logits and, in a step with drafts, every draft position's (zeros otherwise), in
    one pass over the output weights: on CPU that matmul is memory-bound, so a second pass for the drafts
    cost as much as the first (SmolLM2: ~20 ms, a third of a decode step)."""
    positions = drafts.logits_indices.reshape(-1)
    num_sampling = logits_indices.shape[0]

    def with_drafts(hidden):
        rows = jnp.concatenate([logits_indices, positions])
        # a step of fewer token rows than logits rows: the logits of each token row, then picked
        logits = compute_logits(hidden)[rows] if hidden.shape[0] < rows.shape[0] else compute_logits(hidden[rows])
        return logits[:num_sampling], logits[num_sampling:]

    def without_drafts(hidden):
        logits = compute_logits(hidden[logits_indices])
        return logits, jnp.zeros((positions.shape[0], logits.shape[-1]), logits.dtype)

    return jax.lax.cond(jnp.any(drafts.num_draft > 0), with_drafts, without_drafts, hidden)


def verify(draft_logits: Float[Array, "RK1 V"], drafts: DraftInputs, t: SamplingTensors,
           penalty_state: PenaltyState) -> VerifiedTokens:
    """Verify every draft row's drafts against the target's probabilities at their positions
    (draft_logits: the target's logits at each row's logits_indices, row after row)."""
    num_rows, k1 = drafts.logits_indices.shape
    logits = draft_logits.astype(jnp.float32)
    rows = jnp.repeat(drafts.sampling_rows, k1)
    counters = t.counters[rows] + jnp.tile(jnp.arange(k1, dtype=jnp.int32), num_rows)  # the output index sampled
    repeated = dataclasses.replace(jax.tree_util.tree_map(lambda column: column[rows], t), counters=counters)
    processed = process_logits(logits, repeated, penalty_state)
    row_t = jax.tree_util.tree_map(lambda column: column[drafts.sampling_rows], t)
    row_greedy = row_t.temperature <= 0

    def sampled_rows(processed):
        greedy = repeated.temperature <= 0
        probs = jnp.where(greedy[:, None], jax.nn.one_hot(greedy_tokens(processed), logits.shape[-1], dtype=jnp.float32),
                          jax.nn.softmax(random_scaled(processed, repeated), axis=-1))
        return rejection_sample(probs.reshape(num_rows, k1, -1), drafts.token_ids, drafts.num_draft, row_greedy,
                                row_keys(row_t))

    def greedy_rows(processed):
        return greedy_rejection_sample(greedy_tokens(processed).reshape(num_rows, k1), drafts.token_ids, drafts.num_draft)

    # Most verifying steps are all greedy: their softmax, one-hot rows and draws are skipped.
    all_greedy = jnp.all(row_greedy | (drafts.num_draft == 0))
    token_ids, num_accepted = jax.lax.cond(all_greedy, greedy_rows, sampled_rows, processed)
    return VerifiedTokens(token_ids, num_accepted)


def verify_if_drafted(draft_logits: Float[Array, "RK1 V"], drafts: DraftInputs, t: SamplingTensors,
                      penalty_state: PenaltyState) -> VerifiedTokens:
    """`verify`, run only when some row has drafts (most mixed steps have none)."""
    num_rows, k1 = drafts.logits_indices.shape
    skip = lambda *_: VerifiedTokens(jnp.zeros((num_rows, k1), jnp.int32), jnp.zeros(num_rows, jnp.int32))  # noqa: E731
    return jax.lax.cond(jnp.any(drafts.num_draft > 0), verify, skip, draft_logits, drafts, t, penalty_state)
