"""Log-probabilities of chosen tokens with vLLM's ranks, on the device (sampled and prompt tokens alike)."""

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Prompt logprobs project this many token rows at a time: it bounds the step's [rows, vocab]
# scratch (a 8192-token step over a 128k vocabulary would need 4 GiB per array at once).
PROMPT_ROWS_PER_CHUNK = 256


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TokenLogprobs:
    """Per row: one chosen token's logprob and rank, and the row's top N."""

    logprobs: Float[Array, "R"]
    ranks: Int[Array, "R"]  # 1-based over the whole vocabulary: tokens whose logprob >= the token's (vLLM)
    top_ids: Int[Array, "R N"]  # descending by logprob
    top_logprobs: Float[Array, "R N"]


def gather_logprobs(logits: Float[Array, "R V"], token_ids: Int[Array, "R"], num_logprobs: int) -> TokenLogprobs:
    """log_softmax of `logits`, the logprob and true rank of each row's token, and the top num_logprobs."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_ids = jnp.clip(token_ids, 0, logits.shape[-1] - 1)
    token_logprobs = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(logprobs >= token_logprobs[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return TokenLogprobs(token_logprobs, ranks, top_ids.astype(jnp.int32), top_logprobs)


def no_logprobs(num_rows: int, num_logprobs: int) -> TokenLogprobs:
    """Zeros of gather_logprobs' shapes, for the branch of a step where no row asked."""
    return TokenLogprobs(
        jnp.zeros((num_rows,), jnp.float32),
        jnp.zeros((num_rows,), jnp.int32),
        jnp.zeros((num_rows, num_logprobs), jnp.int32),
        jnp.zeros((num_rows, num_logprobs), jnp.float32),
    )


def prompt_logprobs(
    compute_logits: Callable[[Float[Array, "C H"]], Float[Array, "C V"]],
    hidden: Float[Array, "T H"],
    targets: Int[Array, "T"],
    num_logprobs: int,
) -> TokenLogprobs:
    """Per token row, the logprob and rank of `targets` (the next prompt token; -1 where no request
    asked) and the top num_logprobs. Logits of every token row cost a vocab projection each: only
    in steps where some row asked, PROMPT_ROWS_PER_CHUNK rows at a time."""
    num_rows = hidden.shape[0]
    chunk = math.gcd(num_rows, PROMPT_ROWS_PER_CHUNK)

    def all_rows(hidden: Float[Array, "T H"], targets: Int[Array, "T"]) -> TokenLogprobs:
        scored = jax.lax.map(
            lambda rows: gather_logprobs(compute_logits(rows[0]), rows[1], num_logprobs),
            (hidden.reshape(num_rows // chunk, chunk, -1), targets.reshape(num_rows // chunk, chunk)),
        )
        return jax.tree.map(lambda x: x.reshape(num_rows, *x.shape[2:]), scored)

    return jax.lax.cond(
        jnp.any(targets >= 0), all_rows, lambda h, _: no_logprobs(num_rows, num_logprobs), hidden, targets
    )
