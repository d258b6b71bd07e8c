"""On-device sampling with vLLM's semantics, run inside the jitted step.

Per row, in vLLM V1's order: suppress (min_tokens) -> repetition / frequency /
presence penalties -> greedy argmax, or temperature -> min-p -> top-k -> top-p
(over the mass min-p and top-k kept) -> sample. Penalties read the request's
history from the device-side PenaltyState (penalty_state.py). A row's randomness
is fold_in(key(seed), counter) with counter the output index of the token, so a
seeded request samples the same tokens whatever else is in the batch, at
whatever row, however it was scheduled.

Expensive stages sit behind `lax.cond` on "does any row use this": an all-greedy
batch without penalties costs about an argmax. Sorting the vocabulary is far too
slow on CPU (seconds for 256 x 49152), so top-k and top-p find each row's cutoff
logit among its best _TOP_CANDIDATES logits (lax.top_k) and, only when some
row's kept set is larger, by exact bisection on the float bits over the whole
vocabulary. Tokens tied with the cutoff are all kept. Sampling draws one uniform
per row and walks a two-level (block, then token) CDF.
"""

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from cbjax.worker.sample.logprobs import TokenLogprobs, gather_logprobs, no_logprobs
from cbjax.worker.sample.penalty_state import NO_SLOT, PenaltyState, slot_rows
from cbjax.sampling_params import MAX_LOGPROBS, SamplingParams

HostOrDevice = np.ndarray | Array  # the builder fills numpy; the step sees device arrays
_CDF_BLOCK = 256  # vocab block length of the two-level inverse CDF
_TOP_CANDIDATES = 256  # top-k/top-p look here first; the whole vocab only when the kept set is larger
PADDING_TEMPERATURE = -1.0  # marks padding rows: neither greedy nor random, so they cost nothing


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """Sampling settings of S rows (padding rows are marked by PADDING_TEMPERATURE and neutral)."""

    temperature: Float[HostOrDevice, "S"]  # 0 = greedy; -1 = padding row (its token is never read)
    top_p: Float[HostOrDevice, "S"]  # 1 = off
    top_k: Int[HostOrDevice, "S"]  # 0 = off
    min_p: Float[HostOrDevice, "S"]  # 0 = off
    presence_penalty: Float[HostOrDevice, "S"]
    frequency_penalty: Float[HostOrDevice, "S"]
    repetition_penalty: Float[HostOrDevice, "S"]
    seeds: UInt32[HostOrDevice, "S"]
    counters: Int[HostOrDevice, "S"]  # output index of the token being sampled
    penalty_slots: Int[HostOrDevice, "S"]  # the row's PenaltyState slot; NO_SLOT without penalties
    suppress_token_ids: Int[HostOrDevice, "S K"]  # forbidden this step (min_tokens), -1 padded
    wants_logprobs: Int[HostOrDevice, "S"]  # 1 where the request asked for logprobs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens; logprobs is None when `sample` got num_logprobs=None."""

    token_ids: Int[Array, "S"]
    logprobs: TokenLogprobs | None  # raw logprobs: the sampled token's, its rank, the top N


class SamplingRow(NamedTuple):
    """One request's row in the batch, as the runner knows it on the host."""

    params: SamplingParams
    seed: int  # the request's seed, or one the engine derived for it
    counter: int  # number of output tokens so far
    suppress_token_ids: Sequence[int] = ()
    penalty_slot: int = NO_SLOT  # where the request's token history lives on the device


def _column(values: list, num_rows: int, dtype: type, pad: float) -> np.ndarray:
    column = np.full(num_rows, pad, dtype)
    column[: len(values)] = values
    return column


# The SamplingTensors columns of a request that are the same at every step, in row_constants' order,
# with their dtype and the value of padding rows.
_CONSTANT_COLUMNS = (
    ("temperature", np.float32, PADDING_TEMPERATURE), ("top_p", np.float32, 1.0), ("top_k", np.int32, 0),
    ("min_p", np.float32, 0.0), ("presence_penalty", np.float32, 0.0), ("frequency_penalty", np.float32, 0.0),
    ("repetition_penalty", np.float32, 1.0), ("seeds", np.uint32, 0), ("penalty_slots", np.int32, NO_SLOT),
    ("wants_logprobs", np.int32, 0),
)


def row_constants(params: SamplingParams, seed: int, penalty_slot: int = NO_SLOT) -> tuple[float | int, ...]:
    """A request's sampling columns that are the same at every step (the runner makes them once per request)."""
    return (0.0 if params.greedy else params.temperature, params.top_p, params.top_k, params.min_p,
            params.presence_penalty, params.frequency_penalty, params.repetition_penalty, seed % 2**32,
            penalty_slot, int(params.logprobs is not None))


def assemble_sampling_tensors(
    constants: Sequence[tuple[float | int, ...]], counters: Sequence[int], suppressed: dict[int, Sequence[int]],
    num_rows_padded: int, suppress_len: int,
) -> SamplingTensors:
    """Numpy SamplingTensors of S=num_rows_padded rows from each row's row_constants, its counter and,
    for the rows in `suppressed`, the token ids it may not sample; suppress_len is the bucket's width K."""
    num_rows = len(constants)
    if num_rows > num_rows_padded:
        raise ValueError(f"{num_rows} rows to sample but num_rows_padded is {num_rows_padded}; "
                         f"use a bucket of at least {num_rows} rows")
    # One conversion for every constant column (float64 holds each value exactly: float32s, small ints, seeds < 2**32).
    table = np.array(constants, np.float64).reshape(num_rows, len(_CONSTANT_COLUMNS))
    columns = {name: _column(table[:, k], num_rows_padded, dtype, pad) for k, (name, dtype, pad) in enumerate(_CONSTANT_COLUMNS)}
    suppress = np.full((num_rows_padded, suppress_len), -1, np.int32)
    for i, token_ids in suppressed.items():
        if len(token_ids) > suppress_len:
            raise ValueError(f"row {i} suppresses {len(token_ids)} token ids but "
                             f"suppress_len is {suppress_len}; raise suppress_len")
        suppress[i, : len(token_ids)] = token_ids
    return SamplingTensors(**columns, counters=_column(counters, num_rows_padded, np.int32, 0), suppress_token_ids=suppress)


def build_sampling_tensors(rows: Sequence[SamplingRow], num_rows_padded: int, suppress_len: int) -> SamplingTensors:
    """Packs rows into numpy SamplingTensors of S=num_rows_padded rows (one host->device copy);
    suppress_len is the bucket's fixed width K."""
    for i, row in enumerate(rows):
        if row.penalty_slot == NO_SLOT and row.params.has_penalties:
            raise ValueError(f"row {i} has penalties but no penalty_slot; give it its request's slot")
    return assemble_sampling_tensors(
        [row_constants(row.params, row.seed, row.penalty_slot) for row in rows], [row.counter for row in rows],
        {i: row.suppress_token_ids for i, row in enumerate(rows) if row.suppress_token_ids}, num_rows_padded, suppress_len,
    )


def _suppress(logits: Float[Array, "S V"], token_ids: Int[Array, "S K"]) -> Float[Array, "S V"]:
    vocab = logits.shape[-1]
    ids = jnp.where(token_ids >= 0, token_ids, vocab)  # -1 padding -> out of range -> dropped
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def _apply_penalties(logits: Float[Array, "S V"], t: SamplingTensors, state: PenaltyState) -> Float[Array, "S V"]:
    """vLLM: repetition over prompt and output tokens; frequency and presence over output only."""
    seen, output_counts = slot_rows(state, t.penalty_slots)
    repetition = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - t.frequency_penalty[:, None] * output_counts
    return logits - t.presence_penalty[:, None] * (output_counts > 0)


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


def _first_reaching(cdf: Float[Array, "S N"], mass: Float[Array, "S N"], target: Float[Array, "S"]):
    """First index with cdf >= target and mass > 0 (the last with mass > 0 if rounding left none)."""
    positive = mass > 0
    hit = (cdf >= target[:, None]) & positive
    last_positive = mass.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last_positive)


def _inverse_cdf(scaled: Float[Array, "S V"], uniform: Float[Array, "S"]) -> Int[Array, "S"]:
    """Index drawn with probability softmax(scaled), uniform in (0, 1]: pick a vocab block, then a token."""
    num_rows, vocab = scaled.shape
    num_blocks = -(-vocab // _CDF_BLOCK)
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    weights = jnp.pad(weights, ((0, 0), (0, num_blocks * _CDF_BLOCK - vocab)))
    blocks = weights.reshape(num_rows, num_blocks, _CDF_BLOCK)
    block_mass = jnp.sum(blocks, axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = uniform * block_cdf[:, -1]
    block = _first_reaching(block_cdf, block_mass, target)
    mass_before = jnp.take_along_axis(block_cdf - block_mass, block[:, None], axis=-1)[:, 0]
    in_block = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    offset = _first_reaching(jnp.cumsum(in_block, axis=-1), in_block, target - mass_before)
    return (block * _CDF_BLOCK + offset).astype(jnp.int32)


def _sample_random(logits: Float[Array, "S V"], t: SamplingTensors, greedy_ids: Int[Array, "S"]):
    is_random = t.temperature > 0
    scaled = logits / jnp.where(is_random, t.temperature, 1.0)[:, None]
    top_k = jnp.where(is_random, t.top_k, 0)
    top_p = jnp.where(is_random, t.top_p, 1.0)
    # min-p keeps p >= min_p * p_max, i.e. scaled >= max + log(min_p); before top-k/top-p as vLLM V1,
    # so top-p measures the mass of what min-p kept
    floor = jnp.max(scaled, axis=-1) + jnp.log(t.min_p)
    scaled = jnp.where(scaled >= floor[:, None], scaled, -jnp.inf)
    uses_top_k_top_p = jnp.any((top_k > 0) | (top_p < 1.0))
    scaled = jax.lax.cond(uses_top_k_top_p, _top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)
    keys = jax.vmap(lambda seed, counter: jax.random.fold_in(jax.random.key(seed), counter))(
        t.seeds, t.counters)
    uniform = 1.0 - jax.vmap(jax.random.uniform)(keys)  # (0, 1]: never picks a zero-weight token
    return jnp.where(is_random, _inverse_cdf(scaled, uniform), greedy_ids)


def _has_penalties(t: SamplingTensors) -> Bool[Array, ""]:
    return jnp.any((t.presence_penalty != 0) | (t.frequency_penalty != 0) | (t.repetition_penalty != 1))


def sample(
    logits: Float[Array, "S V"], t: SamplingTensors, penalty_state: PenaltyState, num_logprobs: int | None = None
) -> SamplerOutput:
    """Samples one token per row. num_logprobs (static): top-N raw logprobs per row, None for none.

    Logprobs are vLLM's default "raw" ones: log_softmax of the logits before
    suppression, penalties and temperature; the sampled token's rank is over the whole vocabulary.
    penalty_state must already hold this step's input tokens (record_step_tokens).
    """
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"num_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {num_logprobs}")
    raw = logits.astype(jnp.float32)
    processed = _suppress(raw, t.suppress_token_ids)
    processed = jax.lax.cond(_has_penalties(t), _apply_penalties, lambda x, *_: x, processed, t, penalty_state)
    # argmax (lowest index on ties; top_k is 2-3x faster than argmax on CPU), only when some row is
    # greedy: it costs 0.8 ms of a 30 ms SmolLM2 decode step at 16 rows.
    greedy_ids = jax.lax.cond(
        jnp.any(t.temperature == 0),
        lambda x: jax.lax.top_k(x, 1)[1][:, 0],
        lambda x: jnp.zeros(x.shape[:1], jnp.int32),
        processed,
    )
    token_ids = jax.lax.cond(jnp.any(t.temperature > 0), _sample_random, lambda x, _, g: g,
                             processed, t, greedy_ids)
    if num_logprobs is None:
        return SamplerOutput(token_ids, None)
    # A log_softmax and top-k over the vocabulary cost as much as the rest of the sampler: skip
    # them unless some row asked for logprobs.
    logprobs = jax.lax.cond(
        jnp.any(t.wants_logprobs > 0),
        functools.partial(gather_logprobs, num_logprobs=num_logprobs),
        lambda raw, _: no_logprobs(raw.shape[0], num_logprobs),
        raw,
        token_ids,
    )
    return SamplerOutput(token_ids, logprobs)
