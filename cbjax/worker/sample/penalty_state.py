"""Penalty history kept on the device: per request slot, which tokens its prompt holds and how often
each token appears in its output.

Every running request holds a slot (request_slots.py); each step records, for those with penalties, the
step's own input tokens into their slots (position < prompt_len: prompt, else output), so
by the time a request samples, every prompt and output token has passed through. A request
whose step starts at position 0 (a new request, or one recomputing after preemption) has its
slot cleared first. The host sends only slot ids and prompt lengths, never the history, so its
work per step does not grow with max_model_len or with how long requests have run.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

NO_SLOT = -1  # a token or row whose request has no penalties


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    """Donated into every step, updated in place."""

    prompt_seen: Bool[Array, "slots V"]
    output_counts: Int[Array, "slots V"]


def init_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    return PenaltyState(jnp.zeros((num_slots, vocab_size), bool), jnp.zeros((num_slots, vocab_size), jnp.int32))


def penalty_state_bytes(num_slots: int, vocab_size: int) -> int:
    """Device bytes of init_penalty_state's table (a bool and an int32 per slot and token)."""
    return num_slots * vocab_size * (1 + 4)


def _clear_rows(state: PenaltyState, rows: Int[Array, "tokens"]) -> PenaltyState:
    cleared = jnp.zeros(state.prompt_seen.shape[0], bool).at[rows].set(True, mode="drop")[:, None]
    return PenaltyState(state.prompt_seen & ~cleared, jnp.where(cleared, 0, state.output_counts))


def record_step_tokens(
    state: PenaltyState,
    token_ids: Int[Array, "tokens"],
    positions: Int[Array, "tokens"],
    token_slots: Int[Array, "tokens"],
    token_prompt_lens: Int[Array, "tokens"],
) -> PenaltyState:
    """Adds the step's input tokens to their requests' slots (NO_SLOT tokens are skipped)."""
    num_slots = state.prompt_seen.shape[0]
    slots = jnp.where(token_slots >= 0, token_slots, num_slots)  # out of range: dropped by the scatters
    starts = jnp.where(positions == 0, slots, num_slots)
    # Clearing touches every slot's row: only in steps where a penalty request starts.
    state = jax.lax.cond(jnp.any(starts < num_slots), _clear_rows, lambda s, _: s, state, starts)
    is_prompt = positions < token_prompt_lens
    prompt_seen = state.prompt_seen.at[jnp.where(is_prompt, slots, num_slots), token_ids].set(True, mode="drop")
    output_counts = state.output_counts.at[jnp.where(is_prompt, num_slots, slots), token_ids].add(1, mode="drop")
    return PenaltyState(prompt_seen, output_counts)


def slot_rows(
    state: PenaltyState, row_slots: Int[Array, "S"]
) -> tuple[Bool[Array, "S V"], Float[Array, "S V"]]:
    """(token seen in prompt or output, output count) of each sampling row's slot; rows without a
    slot read slot 0, harmless because their penalties are neutral."""
    rows = jnp.clip(row_slots, 0, state.prompt_seen.shape[0] - 1)
    output_counts = state.output_counts[rows]
    return state.prompt_seen[rows] | (output_counts > 0), output_counts.astype(jnp.float32)
