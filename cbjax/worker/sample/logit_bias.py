"""logit_bias (OpenAI's and vLLM's): a per-request bias added to chosen tokens' logits, before
penalties as in vLLM V1. Up to MAX_LOGIT_BIAS entries per request, in two fixed-width columns."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from cbjax.sampling_params import MAX_LOGIT_BIAS
from cbjax.worker.sample.stage import Column, Stage


def add_bias(logits: Float[Array, "S V"], t, _) -> Float[Array, "S V"]:
    vocab = logits.shape[-1]
    ids = jnp.where(t.logit_bias_ids >= 0, t.logit_bias_ids, vocab)  # -1 padding -> out of range -> dropped
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].add(t.logit_bias_values, mode="drop")


def _uses(params) -> bool:
    return bool(params.logit_bias)


STAGE = Stage(
    "logit_bias",
    (
        Column("logit_bias_ids", np.int32, -1, lambda row: list((row.params.logit_bias or {}).keys()),
               width=MAX_LOGIT_BIAS, used_by=_uses),
        Column("logit_bias_values", np.float32, 0.0, lambda row: list((row.params.logit_bias or {}).values()),
               width=MAX_LOGIT_BIAS, used_by=_uses),
    ),
    apply=add_bias,
    in_use=lambda t: (t.logit_bias_ids[:, 0] >= 0).any(),  # left-aligned: a used row fills slot 0
)
