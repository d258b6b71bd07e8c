"""bad_words (vLLM's): token sequences a request's output may not complete. When the request's
latest output tokens equal a sequence's prefix (all but its last token), the last token is banned
for this step; a one-token sequence is always banned. Only output tokens count, not the prompt.

Each sequence is stored right-aligned in MAX_BAD_WORD_TOKENS slots (-1 before it), so its last
token is in the last slot and its prefix lines up with `bad_word_context`, the request's
MAX_BAD_WORD_TOKENS - 1 latest output tokens (-1 where there are fewer). The host writes all of
them but the newest, which it may not have yet (the previous step sampled it on the device): the
step fills that one from its own input tokens (with_newest_output_tokens).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from cbjax.sampling_params import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS
from cbjax.worker.sample.min_tokens import set_to_minus_inf
from cbjax.worker.sample.stage import Column, Stage

CONTEXT_LEN = MAX_BAD_WORD_TOKENS - 1  # output tokens a prefix is compared with


def right_aligned_sequences(params) -> list[int]:
    """The request's bad-word token sequences, each right-aligned in MAX_BAD_WORD_TOKENS slots, flattened."""
    flat: list[int] = []
    for sequence in params.bad_words_token_ids:
        flat += [-1] * (MAX_BAD_WORD_TOKENS - len(sequence)) + list(sequence)
    return flat


def context(row) -> list[int]:
    """The row's latest output tokens before the newest, oldest first, -1 padded in front; the last
    slot (the newest token) stays -1 for the step to fill."""
    known = list(row.output_token_ids[max(0, row.counter - CONTEXT_LEN) : max(0, row.counter - 1)])
    return [-1] * (CONTEXT_LEN - 1 - len(known)) + known + [-1]


def with_newest_output_tokens(t, newest: Int[Array, "S"]):
    """t with each row's newest output token (its step's last input token) in bad_word_context's
    last slot; rows sampling their first output token have none."""
    newest = jnp.where(t.counters > 0, newest, -1)
    return dataclasses.replace(t, bad_word_context=t.bad_word_context.at[:, -1].set(newest))


def ban_completions(logits: Float[Array, "S V"], t, _) -> Float[Array, "S V"]:
    num_rows = logits.shape[0]
    words = t.bad_word_ids.reshape(num_rows, MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS)
    prefixes, last = words[:, :, :-1], words[:, :, -1]
    matches = jnp.all((prefixes < 0) | (prefixes == t.bad_word_context[:, None, :]), axis=-1)
    return set_to_minus_inf(logits, jnp.where(matches, last, -1))  # padding sequences' last is -1


def _uses(params) -> bool:
    return bool(params.bad_words_token_ids)


STAGE = Stage(
    "bad_words",
    (
        Column("bad_word_ids", np.int32, -1, lambda row: right_aligned_sequences(row.params),
               width=MAX_BAD_WORD_SEQUENCES * MAX_BAD_WORD_TOKENS, used_by=_uses),
        Column("bad_word_context", np.int32, -1, context, per_step=True, width=CONTEXT_LEN, used_by=_uses),
    ),
    apply=ban_completions,
    in_use=lambda t: (t.bad_word_ids[:, MAX_BAD_WORD_TOKENS - 1] >= 0).any(),  # a used row's first sequence ends there
)
