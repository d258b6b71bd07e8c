"""min-p: keeps tokens with p >= min_p * p_max, i.e. scaled >= max + log(min_p); before top-k/top-p
as in vLLM V1, so top-p measures the mass of what min-p kept. min_p = 0 keeps everything."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from cbjax.worker.sample.stage import Column, Stage


def keep_above_floor(scaled: Float[Array, "S V"], t) -> Float[Array, "S V"]:
    floor = jnp.max(scaled, axis=-1) + jnp.log(t.min_p)
    return jnp.where(scaled >= floor[:, None], scaled, -jnp.inf)


STAGE = Stage(
    "min_p",
    (Column("min_p", np.float32, 0.0, lambda row: row.params.min_p),),
    apply=keep_above_floor,
    in_use=lambda t: (t.min_p > 0).any(),
)
