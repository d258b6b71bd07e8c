"""Structured outputs' stage: a constrained row's logits outside its grammar's allowed tokens become -inf.

Each row declares only whether it is constrained (a narrow column); the step's packed masks,
[rows, ceil(V/32)] int32 filled on the host from each constrained row's grammar, travel beside the
sampling columns (runner.StepInputs.grammar_bitmask) and are read for the constrained rows alone.
The step applies it before the sampler, as vLLM's runner does: the sampled distribution and the
raw logprobs are both those of the masked logits (vLLM's default logprobs mode, "raw_logprobs").
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int32

from cbjax.worker.sample.grammar_bitmask import apply_grammar_bitmask
from cbjax.worker.sample.stage import Column, Stage


def mask_logits(logits: Float[Array, "S V"], t, bitmask: Int32[Array, "S W"]) -> Float[Array, "S V"]:
    """Row s keeps the logits bitmask[s] allows where it is constrained; the others pass unchanged."""
    mask_rows = jnp.where(t.grammar_constrained > 0, jnp.arange(logits.shape[0], dtype=jnp.int32), -1)
    return apply_grammar_bitmask(logits, mask_rows, bitmask)


def masked(logits: Float[Array, "S V"], t, bitmask: Int32[Array, "S W"]) -> Float[Array, "S V"]:
    """mask_logits when some row is constrained (the unpacking skipped otherwise)."""
    return jax.lax.cond(STAGE.in_use(t), mask_logits, lambda x, *_: x, logits, t, bitmask)


STAGE = Stage(
    "grammar",
    (Column("grammar_constrained", np.int32, 0, lambda row: int(row.params.structured_outputs is not None)),),
    apply=mask_logits,
    in_use=lambda t: (t.grammar_constrained > 0).any(),
)
