"""min_tokens: until a request has min_tokens outputs, its stop and eos token ids may not be sampled.

The ids held back this step go in a fixed-width column (-1 padded) that the runner fills per step.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from cbjax.sampling_params import SamplingParams
from cbjax.worker.sample.stage import Column, Stage

SUPPRESS_LEN = 16  # width of the column: stop_token_ids plus eos ids a request may hold back


def suppressed_ids(params: SamplingParams, output_index: int, eos_token_ids: Sequence[int]) -> list[int]:
    """The token ids a request may not sample as its output `output_index` (none once past min_tokens)."""
    if output_index >= params.min_tokens:
        return []
    return list(params.stop_token_ids or []) + ([] if params.ignore_eos else list(eos_token_ids))


def set_to_minus_inf(logits: Float[Array, "S V"], token_ids: Array) -> Float[Array, "S V"]:
    """logits[row, token_ids[row, k]] = -inf for every k (token_ids[S, K], -1 padded)."""
    vocab = logits.shape[-1]
    ids = jnp.where(token_ids >= 0, token_ids, vocab)  # -1 padding -> out of range -> dropped
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


STAGE = Stage(
    "min_tokens",
    (Column("suppress_token_ids", np.int32, -1, lambda row: row.suppress_token_ids, per_step=True,
            width=SUPPRESS_LEN, used_by=lambda params: params.min_tokens > 0),),
    apply=lambda logits, t, _: set_to_minus_inf(logits, t.suppress_token_ids),
    in_use=lambda t: (t.suppress_token_ids[:, 0] >= 0).any(),  # left-aligned: a used row fills slot 0
)
