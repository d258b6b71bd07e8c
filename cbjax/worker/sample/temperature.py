"""Temperature: random rows' logits divided by their temperature (greedy rows never reach it)."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from cbjax.worker.sample.stage import Column, Stage

PADDING_TEMPERATURE = -1.0  # marks padding rows: neither greedy nor random, so they cost nothing


def scale(logits: Float[Array, "S V"], t) -> Float[Array, "S V"]:
    return logits / jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]


STAGE = Stage(
    "temperature",
    # 0 = greedy; PADDING_TEMPERATURE = padding row (its token is never read)
    (Column("temperature", np.float32, PADDING_TEMPERATURE,
            lambda row: 0.0 if row.params.greedy else row.params.temperature),),
    apply=scale,
    in_use=lambda t: (t.temperature > 0).any(),
)
