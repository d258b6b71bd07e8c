"""Speculative verification (Leviathan et al., as vLLM's rejection_sampler.py), on device.

Each speculating row scores its k draft tokens plus one bonus position. Greedy rows accept while
the draft equals the target's argmax; random rows accept draft i with probability
min(1, p_target/p_draft), which for one-hot drafts (n-gram, suffix) is p_target(draft). At the
first rejection the token is drawn from normalised max(0, p_target - p_draft), i.e. the target
with the draft token removed; if every draft is accepted a bonus token is drawn from the target at
position k. The output is distributed exactly as sampling the target token by token.

`target_probs` are the probabilities after the rest of the pipeline (penalties, temperature,
top-k/p...) at every verified position. Keys are per row (fold_in(key(seed), counter) as the
sampler's), so a seeded request verifies the same way whatever the batch.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

REJECTED = -1  # output slots after the first rejected/bonus token


def _verify_row(probs: Float[Array, "K1 V"], draft: Int[Array, " K"], num_draft: Int[Array, ""],
                greedy: Bool[Array, ""], key: Key[Array, ""]) -> tuple[Int[Array, " K1"], Int[Array, ""]]:
    k = draft.shape[0]
    accept_key, draw_key = jax.random.split(key)
    positions = jnp.arange(k)
    argmax = jnp.argmax(probs, axis=-1)
    p_draft = probs[positions, draft]
    accepted = jnp.where(greedy, draft == argmax[:k], jax.random.uniform(accept_key, (k,)) < p_draft)
    accepted = accepted & (positions < num_draft)
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32)))
    target = probs[num_accepted]
    # A rejection removes the (one-hot) draft's mass; after all drafts were accepted: the bonus draw.
    rejected = num_accepted < num_draft
    residual = jnp.where(rejected, target.at[draft[jnp.minimum(num_accepted, k - 1)]].set(0.0), target)
    drawn = jax.random.categorical(draw_key, jnp.log(residual))
    token = jnp.where(greedy, argmax[num_accepted], drawn)
    return _run(draft, num_accepted, token), num_accepted


def _run(draft: Int[Array, " K"], num_accepted: Int[Array, ""], token: Int[Array, ""]) -> Int[Array, " K1"]:
    """The row's output slots: its accepted drafts, then `token`, then REJECTED."""
    slots = jnp.arange(draft.shape[0] + 1)
    padded_draft = jnp.concatenate([draft, jnp.zeros((1,), draft.dtype)])
    return jnp.where(slots < num_accepted, padded_draft, jnp.where(slots == num_accepted, token, REJECTED)).astype(jnp.int32)


def rejection_sample(
    target_probs: Float[Array, "R K1 V"], draft_ids: Int[Array, "R K"], num_draft: Int[Array, " R"],
    greedy: Bool[Array, " R"], keys: Key[Array, " R"],
) -> tuple[Int[Array, "R K1"], Int[Array, " R"]]:
    """-> (tokens [R, k+1]: accepted drafts, then the resampled or bonus token, then REJECTED;
    num_accepted [R]: drafts accepted, so each row emits num_accepted + 1 tokens).
    Rows with num_draft < k verify only their first num_draft drafts (0: a plain sample)."""
    if draft_ids.shape[1] < 1:
        raise ValueError(f"rejection_sample needs k >= 1 draft slots, got draft_ids of shape {draft_ids.shape}; "
                         "rows without drafts pass num_draft=0")
    return jax.vmap(_verify_row)(target_probs, draft_ids, num_draft, greedy, keys)


def greedy_rejection_sample(
    target_ids: Int[Array, "R K1"], draft_ids: Int[Array, "R K"], num_draft: Int[Array, " R"],
) -> tuple[Int[Array, "R K1"], Int[Array, " R"]]:
    """rejection_sample for rows that are all greedy, from the target's argmax at each position alone:
    the same output without a probability row (each [V] wide) per position."""
    k = draft_ids.shape[1]
    accepted = (draft_ids == target_ids[:, :k]) & (jnp.arange(k) < num_draft[:, None])
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
    tokens = jnp.take_along_axis(target_ids, num_accepted[:, None], axis=1)[:, 0]
    return jax.vmap(_run)(draft_ids, num_accepted, tokens), num_accepted
