"""allowed_token_ids (vLLM's): every token outside the request's list gets -inf. Up to
MAX_ALLOWED_TOKEN_IDS ids per request, in a fixed-width column; an empty row allows everything."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from cbjax.sampling_params import MAX_ALLOWED_TOKEN_IDS
from cbjax.worker.sample.stage import Column, Stage


def keep_allowed(logits: Float[Array, "S V"], t, _) -> Float[Array, "S V"]:
    num_rows, vocab = logits.shape
    ids = jnp.where(t.allowed_token_ids >= 0, t.allowed_token_ids, vocab)  # padding -> dropped
    allowed = jnp.zeros((num_rows, vocab), bool).at[jnp.arange(num_rows)[:, None], ids].set(True, mode="drop")
    restricted = (t.allowed_token_ids[:, 0] >= 0)[:, None]  # validation keeps a used list non-empty
    return jnp.where(restricted & ~allowed, -jnp.inf, logits)


STAGE = Stage(
    "allowed_token_ids",
    (Column("allowed_token_ids", np.int32, -1, lambda row: row.params.allowed_token_ids or [],
            width=MAX_ALLOWED_TOKEN_IDS, used_by=lambda params: params.allowed_token_ids is not None),),
    apply=keep_allowed,
    in_use=lambda t: (t.allowed_token_ids[:, 0] >= 0).any(),  # left-aligned: a used row fills slot 0
)
