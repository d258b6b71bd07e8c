"""On-device sampling with vLLM's semantics, run inside the jitted step: a pipeline of stages.

Per row, in vLLM V1's order: the logits stages (allowed_token_ids -> bad_words -> min_tokens ->
logit_bias -> penalties), then greedy argmax, or the random stages (temperature -> min-p -> top-k
-> top-p over the mass min-p and top-k kept) and a draw. One file per stage (stage.py says what a
stage is); SamplingTensors and the host's row builders below are made from the stages' column
declarations, so a new sampling feature is one stage file plus its SamplingParams field.

A row's randomness is fold_in(key(seed), counter) with counter the output index of the token, so
a seeded request samples the same tokens whatever else is in the batch, at whatever row, however
it was scheduled. Expensive stages sit behind `lax.cond` on "does any row use this": an
all-greedy batch without penalties costs about an argmax. Sampling draws one uniform per row and
walks a two-level (block, then token) CDF.
"""

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

from cbjax.sampling_params import MAX_LOGPROBS, SamplingParams
from cbjax.worker.sample import (allowed_token_ids, bad_words, grammar, logit_bias, min_p, min_tokens, penalties,
                                 temperature, top_k_top_p)
from cbjax.worker.sample.logprobs import TokenLogprobs, gather_logprobs, no_logprobs
from cbjax.worker.sample.penalty_state import NO_SLOT, PenaltyState
from cbjax.worker.sample.stage import Column, Stage, left_aligned

HostOrDevice = np.ndarray | Array  # the builder fills numpy; the step sees device arrays
_CDF_BLOCK = 256  # vocab block length of the two-level inverse CDF

# Stages on every row's logits, (logits, t, penalty_state) -> logits, in vLLM V1's order.
LOGITS_STAGES: tuple[Stage, ...] = (
    allowed_token_ids.STAGE, bad_words.STAGE, min_tokens.STAGE, logit_bias.STAGE, penalties.STAGE)
# Stages of random rows after the greedy argmax, (logits, t) -> logits, in order.
RANDOM_STAGES: tuple[Stage, ...] = (temperature.STAGE, min_p.STAGE, top_k_top_p.STAGE)
# The draw's and logprobs' own columns.
DRAW_COLUMNS = (
    Column("seeds", np.uint32, 0, lambda row: row.seed % 2**32),
    Column("wants_logprobs", np.int32, 0, lambda row: int(row.params.logprobs is not None)),  # 1: asked
)
COUNTERS = Column("counters", np.int32, 0, lambda row: row.counter, per_step=True)  # output index sampled now
# The grammar's stage runs in the step before `sample` (grammar.py says why); its column is declared here too.
COLUMNS: tuple[Column, ...] = (*(c for s in LOGITS_STAGES + RANDOM_STAGES + (grammar.STAGE,) for c in s.columns),
                               *DRAW_COLUMNS, COUNTERS)
# Stages whose inputs change from step to step (their columns, or the grammar's masks): a step using
# one is built row by row (persistent_batch.py).
PER_STEP_STAGES = (*(stage for stage in LOGITS_STAGES + RANDOM_STAGES if stage.per_step), grammar.STAGE)

_SCALAR_CONSTANTS = tuple(c for c in COLUMNS if not c.per_step and c.width is None)
_WIDE_CONSTANTS = tuple(c for c in COLUMNS if not c.per_step and c.width is not None)
_STEP_COLUMNS = tuple(c for c in COLUMNS if c.per_step and c is not COUNTERS)


def _annotation(column: Column) -> type:
    kind = {np.float32: Float, np.int32: Int, np.uint32: UInt32}[column.dtype]
    return kind[HostOrDevice, "S" if column.width is None else f"S {column.name}"]


# Sampling settings of S rows, one field per declared column (padding rows hold each column's neutral pad).
SamplingTensors = dataclasses.make_dataclass("SamplingTensors", [(c.name, _annotation(c)) for c in COLUMNS], frozen=True)
SamplingTensors.__module__ = __name__  # pickles by name, as a written dataclass
jax.tree_util.register_dataclass(SamplingTensors)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens; logprobs is None when `sample` got num_logprobs=None."""

    token_ids: Int[Array, "S"]
    logprobs: TokenLogprobs | None  # raw logprobs: the sampled token's, its rank, the top N


class SamplingRow(NamedTuple):
    """One request's row in the batch, as the runner knows it on the host (what columns read)."""

    params: SamplingParams
    seed: int  # the request's seed, or one the engine derived for it
    counter: int  # number of output tokens so far
    suppress_token_ids: Sequence[int] = ()  # held back this step (min_tokens.suppressed_ids)
    penalty_slot: int = NO_SLOT  # where the request's token history lives on the device
    output_token_ids: Sequence[int] = ()  # the request's output tokens the host has (all but maybe the newest)


class RequestColumns(NamedTuple):
    """A request's values of the columns that are the same at every step, made once per request."""

    scalars: tuple[float | int, ...]  # of the one-value columns, in _SCALAR_CONSTANTS' order
    wide: tuple[tuple[int, np.ndarray], ...]  # (index in _WIDE_CONSTANTS, padded row) of those it uses
    per_step: tuple[int, ...]  # indices in _STEP_COLUMNS it uses: read at each step from a SamplingRow


def request_columns(params: SamplingParams, seed: int, penalty_slot: int = NO_SLOT) -> RequestColumns:
    """A request's constant columns (the runner makes them once, when it first gets its slot)."""
    row = SamplingRow(params, seed, 0, penalty_slot=penalty_slot)
    wide = tuple((k, left_aligned(c.value(row), c.width, c.pad, c.dtype))
                 for k, c in enumerate(_WIDE_CONSTANTS) if c.used_by(params))
    return RequestColumns(tuple(c.value(row) for c in _SCALAR_CONSTANTS), wide,
                          tuple(k for k, c in enumerate(_STEP_COLUMNS) if c.used_by(params)))


def joining_request_columns(params: SamplingParams, seed: int, penalty_slot: int,
                            eos_token_ids: Sequence[int]) -> RequestColumns:
    """request_columns, written once into a row of their dtypes as the request's first step writes
    them: a value a column cannot hold (an id beyond int32, say) raises here, for this request
    alone, not inside a whole step's assemble_sampling_tensors."""
    columns = request_columns(params, seed, penalty_slot)
    first = SamplingRow(params, seed, 0, min_tokens.suppressed_ids(params, 0, eos_token_ids), penalty_slot)
    assemble_sampling_tensors([columns], [0], {0: first} if columns.per_step else {}, 1)
    return columns


def assemble_sampling_tensors(
    constants: Sequence[RequestColumns], counters: Sequence[int], step_rows: dict[int, SamplingRow],
    num_rows_padded: int, suppress_len: int = min_tokens.SUPPRESS_LEN,
) -> SamplingTensors:
    """Numpy SamplingTensors of S=num_rows_padded rows from each row's request_columns, its counter
    and, for the rows in `step_rows` (those with per-step columns), its SamplingRow; suppress_len
    is the width of the min_tokens column (the bucket's)."""
    num_rows = len(constants)
    if num_rows > num_rows_padded:
        raise ValueError(f"{num_rows} rows to sample but num_rows_padded is {num_rows_padded}; "
                         f"use a bucket of at least {num_rows} rows")
    # One conversion for every one-value column (float64 holds each exactly: float32s, small ints, seeds < 2**32).
    table = np.array([c.scalars for c in constants], np.float64).reshape(num_rows, len(_SCALAR_CONSTANTS))
    columns = {c.name: left_aligned(table[:, k], num_rows_padded, c.pad, c.dtype) for k, c in enumerate(_SCALAR_CONSTANTS)}
    columns.update((c.name, c.padded(num_rows_padded)) for c in _WIDE_CONSTANTS)
    for i in [i for i, c in enumerate(constants) if c.wide]:
        for k, values in constants[i].wide:
            columns[_WIDE_CONSTANTS[k].name][i] = values
    widths = {c.name: suppress_len if c.name == "suppress_token_ids" else c.width for c in _STEP_COLUMNS}
    columns.update((c.name, np.full((num_rows_padded, widths[c.name]), c.pad, c.dtype)) for c in _STEP_COLUMNS)
    for i, row in step_rows.items():
        for k in constants[i].per_step:
            column = _STEP_COLUMNS[k]
            values = column.value(row)
            if len(values) > widths[column.name]:
                raise ValueError(f"row {i} has {len(values)} {column.name} but the column holds "
                                 f"{widths[column.name]}; raise its width or pass fewer")
            columns[column.name][i, : len(values)] = values
    columns[COUNTERS.name] = left_aligned(counters, num_rows_padded, COUNTERS.pad, COUNTERS.dtype)
    return SamplingTensors(**columns)


def build_sampling_tensors(rows: Sequence[SamplingRow], num_rows_padded: int,
                           suppress_len: int = min_tokens.SUPPRESS_LEN) -> SamplingTensors:
    """Packs rows into numpy SamplingTensors of S=num_rows_padded rows (one host->device copy);
    every row's per-step columns are read from it."""
    for i, row in enumerate(rows):
        if row.penalty_slot == NO_SLOT and row.params.has_penalties:
            raise ValueError(f"row {i} has penalties but no penalty_slot; give it its request's slot")
    every_step_column = tuple(range(len(_STEP_COLUMNS)))
    constants = [request_columns(row.params, row.seed, row.penalty_slot)._replace(per_step=every_step_column)
                 for row in rows]
    return assemble_sampling_tensors(constants, [row.counter for row in rows], dict(enumerate(rows)),
                                     num_rows_padded, suppress_len)


def any_in_use(stages: Sequence[Stage], t: SamplingTensors) -> Bool[Array, ""]:
    """Whether some row uses one of `stages` (host or device arrays)."""
    return functools.reduce(lambda a, b: a | b, (stage.in_use(t) for stage in stages))


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


def random_scaled(logits: Float[Array, "S V"], t: SamplingTensors) -> Float[Array, "S V"]:
    """The random stages' logits: a random row samples softmax of them."""
    for stage in RANDOM_STAGES:
        logits = stage.apply(logits, t)
    return logits


def row_keys(t: SamplingTensors) -> Array:
    """Each row's key, fold_in(key(seed), counter): the same for a request whatever its row and batch."""
    return jax.vmap(lambda seed, counter: jax.random.fold_in(jax.random.key(seed), counter))(t.seeds, t.counters)


def greedy_tokens(processed: Float[Array, "S V"]) -> Int[Array, "S"]:
    """argmax, lowest index on ties (top_k is 2-3x faster than argmax on CPU)."""
    return jax.lax.top_k(processed, 1)[1][:, 0]


def _sample_random(logits: Float[Array, "S V"], t: SamplingTensors, greedy_ids: Int[Array, "S"]):
    scaled = random_scaled(logits, t)
    keys = row_keys(t)
    uniform = 1.0 - jax.vmap(jax.random.uniform)(keys)  # (0, 1]: never picks a zero-weight token
    return jnp.where(t.temperature > 0, _inverse_cdf(scaled, uniform), greedy_ids)


def process_logits(logits: Float[Array, "S V"], t: SamplingTensors, penalty_state: PenaltyState) -> Float[Array, "S V"]:
    """The logits stages, each only when some row uses it."""
    for stage in LOGITS_STAGES:
        logits = jax.lax.cond(stage.in_use(t), stage.apply, lambda x, *_: x, logits, t, penalty_state)
    return logits


def sample(
    logits: Float[Array, "S V"], t: SamplingTensors, penalty_state: PenaltyState, num_logprobs: int | None = None
) -> SamplerOutput:
    """Samples one token per row. num_logprobs (static): top-N raw logprobs per row, None for none.

    Logprobs are vLLM's default "raw" ones: log_softmax of the logits before
    the logits stages and temperature; the sampled token's rank is over the whole vocabulary.
    penalty_state must already hold this step's input tokens (record_step_tokens), and
    t.bad_word_context each row's newest output token (bad_words.with_newest_output_tokens).
    """
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"num_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {num_logprobs}")
    raw = logits.astype(jnp.float32)
    processed = process_logits(raw, t, penalty_state)
    # argmax only when some row is greedy: it costs 0.8 ms of a 30 ms SmolLM2 decode step at 16 rows.
    greedy_ids = jax.lax.cond(
        jnp.any(t.temperature == 0),
        greedy_tokens,
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
