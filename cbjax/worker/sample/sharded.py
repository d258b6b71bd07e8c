"""Sampling from logits split over the vocabulary (tensor parallelism), without gathering whole rows.

Under TP the LM head is split by vocabulary, so each device holds a [rows, vocab / N] slice of
the logits. Gathering them whole moves rows x vocab floats to every device each step (256 rows
of a 128k vocabulary: 128 MiB); instead each device takes its slice's top SHARD_CANDIDATES
logits (lax.top_k) with their global token ids, and the sampler runs on those N x k candidates,
as tpu-inference and sglang-jax do. That is exact, with the same tokens as the one-device
sampler for the same seeds, when every row is greedy or samples with 0 < top_k <= k: the kept
set is then within the global top-k, which lies within the candidates (each device's slice
holds its share of the global top-k among its own top k). The candidates are put in token-id
order, so the inverse CDF walks the kept tokens in the order `sample` walks the vocabulary.

Rows that need the whole vocabulary row take the gather path (the plain sampler on gathered
logits): any logits stage in use (penalties' table is a whole row per request; min_tokens,
bad_words, allowed_token_ids and logit_bias move tokens that may not be among the candidates),
logprobs (the log-softmax normaliser and the true rank span the vocabulary), and random rows
with top_k = 0 or top_k > k (plain temperature, top-p or min-p alone keep tokens outside any
top k). One such row sends the whole batch down that path, chosen on the device by lax.cond.
Tokens tied with the k-th logit of a slice beyond its k are not candidates (ties of float
logits; the one-device sampler keeps every token tied with the cutoff).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from cbjax.worker.sample.logprobs import no_logprobs
from cbjax.worker.sample.penalty_state import PenaltyState
from cbjax.worker.sample.sampler import LOGITS_STAGES, SamplerOutput, SamplingTensors, _sample_random, any_in_use, sample
from cbjax.models.layers.mesh import MODEL_AXIS

SHARD_CANDIDATES = 64  # per device: the largest top_k served without gathering the vocabulary


def needs_whole_rows(t: SamplingTensors, num_logprobs: int | None, k: int = SHARD_CANDIDATES) -> Bool[Array, ""]:
    """True when some row needs the whole vocabulary row (see the module docstring)."""
    random_rows_fit = (t.temperature <= 0) | ((t.top_k > 0) & (t.top_k <= k))
    needs = any_in_use(LOGITS_STAGES, t) | ~jnp.all(random_rows_fit)
    if num_logprobs is not None:
        needs = needs | jnp.any(t.wants_logprobs > 0)
    return needs


def shard_candidates(
    logits: Float[Array, "S V"], mesh: jax.sharding.Mesh, k: int
) -> tuple[Float[Array, "S C"], Int[Array, "S C"]]:
    """Each device's top k logits of its vocabulary slice with their token ids, C = devices x k,
    merged and put in token-id order (replicated: a few KiB instead of the rows)."""

    def local_top_k(block: Float[Array, "S Vd"]) -> tuple[Float[Array, "S k"], Int[Array, "S k"]]:
        values, indices = jax.lax.top_k(block, k)
        return values, indices + jax.lax.axis_index(MODEL_AXIS) * block.shape[-1]

    sliced = P(None, MODEL_AXIS)
    values, token_ids = jax.shard_map(local_top_k, mesh=mesh, in_specs=sliced, out_specs=(sliced, sliced))(logits)
    replicated = NamedSharding(mesh, P())
    values = jax.lax.with_sharding_constraint(values, replicated)
    token_ids = jax.lax.with_sharding_constraint(token_ids, replicated)
    order = jnp.argsort(token_ids, axis=-1)
    return jnp.take_along_axis(values, order, axis=-1), jnp.take_along_axis(token_ids, order, axis=-1)


def sample_from_candidates(
    logits: Float[Array, "S V"], t: SamplingTensors, mesh: jax.sharding.Mesh, k: int = SHARD_CANDIDATES
) -> Int[Array, "S"]:
    """One token per row from the devices' candidates; exact only where needs_whole_rows is False."""
    values, token_ids = shard_candidates(logits.astype(jnp.float32), mesh, k)
    greedy = jnp.argmax(values, axis=-1)  # the lowest token id among tied maxima, as the one-device sampler
    position = jax.lax.cond(jnp.any(t.temperature > 0), _sample_random, lambda x, _, g: g, values, t, greedy)
    return jnp.take_along_axis(token_ids, position[:, None], axis=-1)[:, 0]


def sample_vocab_sharded(
    logits: Float[Array, "S V"],
    t: SamplingTensors,
    penalty_state: PenaltyState,
    num_logprobs: int | None,
    mesh: jax.sharding.Mesh,
) -> SamplerOutput:
    """`sample` for logits split over the vocabulary on `mesh`'s model axis: from the devices'
    candidates when that is exact, else from the gathered rows."""

    def gathered(logits: Float[Array, "S V"]) -> SamplerOutput:
        rows = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
        return sample(rows, t, penalty_state, num_logprobs)

    vocab, num_devices = logits.shape[-1], mesh.shape[MODEL_AXIS]
    if vocab % num_devices or vocab // num_devices < SHARD_CANDIDATES:  # no even slices of k candidates each
        return gathered(logits)

    def from_candidates(logits: Float[Array, "S V"]) -> SamplerOutput:
        token_ids = sample_from_candidates(logits, t, mesh)
        logprobs = None if num_logprobs is None else no_logprobs(logits.shape[0], num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    return jax.lax.cond(needs_whole_rows(t, num_logprobs), gathered, from_candidates, logits)
