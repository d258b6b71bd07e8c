"""Top-k, then top-p over the renormalised top-k (ties with the cutoff kept), of random rows.

Sorting the vocabulary is far too slow on CPU (seconds for 256 x 49152), so each row's cutoff
logit is found among its best _TOP_CANDIDATES logits (lax.top_k) and, only when some row's kept
set is larger, by exact bisection on the float bits over the whole vocabulary.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt32

from cbjax.worker.sample.stage import Column, Stage

_TOP_CANDIDATES = 256  # top-k/top-p look here first; the whole vocab only when the kept set is larger


def _ordered_bits(x: Float[Array, "S V"]) -> UInt32[Array, "S V"]:
    """Maps f32 to u32 so that unsigned order equals float order (NaN-free input)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_ordered_bits(keys: UInt32[Array, "S"]) -> Float[Array, "S"]:
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_threshold(
    keys: UInt32[Array, "S V"], weights: Float[Array, "S V"], target: Float[Array, "S"]
) -> UInt32[Array, "S"]:
    """Per row, the largest key t with sum(weights[keys >= t]) >= target, by bisection."""

    def halve(_, bounds):
        low, high = bounds  # invariant: the answer lies in [low, high]
        mid = low + ((high - low) >> 1) + ((high - low) & 1)  # upper half-point, overflow-free
        ok = jnp.sum(jnp.where(keys >= mid[:, None], weights, 0.0), axis=-1) >= target
        return jnp.where(ok, mid, low), jnp.where(ok, high, mid - 1)

    num_rows = keys.shape[0]
    start = (jnp.zeros(num_rows, jnp.uint32), jnp.full(num_rows, 2**32 - 1, jnp.uint32))
    return jax.lax.fori_loop(0, 32, halve, start)[0]


def _cutoff_by_bisection(scaled: Float[Array, "S V"], top_k: Int[Array, "S"], top_p: Float[Array, "S"]):
    """Exact top-k then top-p cutoff logit over the whole vocabulary (the slow, general path)."""
    keys = _ordered_bits(scaled)
    kth = _largest_threshold(keys, jnp.ones_like(scaled), top_k.astype(jnp.float32))
    in_top_k = (top_k[:, None] <= 0) | (keys >= kth[:, None])
    weights = jnp.where(in_top_k, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    nucleus_end = _largest_threshold(keys, weights, top_p * jnp.sum(weights, axis=-1))
    cutoff = jnp.where(top_p < 1, _from_ordered_bits(nucleus_end), _from_ordered_bits(kth))
    return jnp.where((top_k > 0) | (top_p < 1), cutoff, -jnp.inf)


def _cutoff_from_candidates(scaled: Float[Array, "S V"], top_k: Int[Array, "S"], top_p: Float[Array, "S"]):
    """Top-k then top-p cutoff logit found among each row's best logits; fits is False
    for rows whose kept set may reach beyond them."""
    vocab = scaled.shape[-1]
    num_candidates = min(_TOP_CANDIDATES, vocab)
    # Only indexed reads of `best`: a slice of top_k's output makes XLA CPU sort the whole vocab.
    best = jax.lax.top_k(scaled, num_candidates)[0]  # descending
    kth = jnp.take_along_axis(best, jnp.clip(top_k - 1, 0, num_candidates - 1)[:, None], axis=-1)[:, 0]
    kth = jnp.where(top_k > 0, kth, -jnp.inf)
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    weights = jnp.where(best >= kth[:, None], jnp.exp(best - row_max), 0.0)
    mass = jnp.where(top_k > 0, jnp.sum(weights, axis=-1), jnp.sum(jnp.exp(scaled - row_max), axis=-1))
    reached = jnp.cumsum(weights, axis=-1) >= (top_p * mass)[:, None]
    nucleus_end = jnp.take_along_axis(best, jnp.argmax(reached, axis=-1)[:, None], axis=-1)[:, 0]
    fits_k = (top_k <= 0) | (kth > jnp.min(best, axis=-1)) | (num_candidates == vocab)
    fits_p = (top_p >= 1) | jnp.any(reached, axis=-1)
    return jnp.where(top_p < 1, nucleus_end, kth), fits_k & fits_p


def _top_k_top_p(scaled: Float[Array, "S V"], top_k: Int[Array, "S"], top_p: Float[Array, "S"]):
    """Masks to -inf what top-k, then top-p over the renormalised top-k, leave out (ties kept)."""
    cutoff, fits = _cutoff_from_candidates(scaled, top_k, top_p)
    cutoff = jax.lax.cond(jnp.all(fits), lambda *_: cutoff, _cutoff_by_bisection, scaled, top_k, top_p)
    return jnp.where(scaled >= cutoff[:, None], scaled, -jnp.inf)


def apply_top_k_top_p(scaled: Float[Array, "S V"], t) -> Float[Array, "S V"]:
    """Only random rows (temperature > 0) filter; the whole stage runs only when some row uses it."""
    is_random = t.temperature > 0
    # As vLLM clamps top_k to the vocabulary: a top_k of the vocabulary or more keeps every token (off).
    top_k = jnp.where(is_random & (t.top_k < scaled.shape[-1]), t.top_k, 0)
    top_p = jnp.where(is_random, t.top_p, 1.0)
    uses_top_k_top_p = jnp.any((top_k > 0) | (top_p < 1.0))
    return jax.lax.cond(uses_top_k_top_p, _top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)


STAGE = Stage(
    "top_k_top_p",
    (
        # 0 = off, as is a top_k of the vocabulary or more (apply_top_k_top_p): larger ones fit int32 clamped.
        Column("top_k", np.int32, 0, lambda row: min(row.params.top_k, np.iinfo(np.int32).max)),
        Column("top_p", np.float32, 1.0, lambda row: row.params.top_p),  # 1 = off
    ),
    apply=apply_top_k_top_p,
    in_use=lambda t: ((t.top_k > 0) | (t.top_p < 1.0)).any(),
)
