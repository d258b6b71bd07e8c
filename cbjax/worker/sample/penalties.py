"""Repetition, frequency and presence penalties (vLLM's): repetition over prompt and output tokens,
frequency and presence over output tokens, read from the request's slot of the device-side
PenaltyState (penalty_state.py)."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from cbjax.worker.sample.penalty_state import NO_SLOT, PenaltyState, slot_rows
from cbjax.worker.sample.stage import Column, Stage


def apply_penalties(logits: Float[Array, "S V"], t, state: PenaltyState) -> Float[Array, "S V"]:
    seen, output_counts = slot_rows(state, t.penalty_slots)
    repetition = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - t.frequency_penalty[:, None] * output_counts
    return logits - t.presence_penalty[:, None] * (output_counts > 0)


def has_penalties(t):
    """Whether some row's penalties change its logits (host numpy or device arrays)."""
    return ((t.presence_penalty != 0) | (t.frequency_penalty != 0) | (t.repetition_penalty != 1)).any()


STAGE = Stage(
    "penalties",
    (
        Column("presence_penalty", np.float32, 0.0, lambda row: row.params.presence_penalty),
        Column("frequency_penalty", np.float32, 0.0, lambda row: row.params.frequency_penalty),
        Column("repetition_penalty", np.float32, 1.0, lambda row: row.params.repetition_penalty),
        # the row's PenaltyState slot; NO_SLOT for rows without penalties
        Column("penalty_slots", np.int32, NO_SLOT, lambda row: row.penalty_slot),
    ),
    apply=apply_penalties,
    in_use=has_penalties,
)
