"""A decode step that follows the previous one: its inputs gathered from that step's, not rebuilt.

Most steps of a busy engine are decode steps over the requests of the step before, each one
position further on, less those that finished (continuous batching). vLLM keeps such a batch in
persistent per-row arrays (its InputBatch) and rewrites only what changed; here each row's
columns are gathered from its request's row in the previous step's host inputs with whole-column
numpy operations, moved on by one position, and the rows keep their request slots: only the rows
that gained a block in this step's schedule (`SchedulerOutput.allocated`) send its entry for the
device's block table (block_table.py). The runner's
row-by-row `prepare` builds every other step (and this one's first), and the two must agree:
tests/worker/test_persistent_batch.py checks that they do.

Each row's input token is taken on the device from what its request's row sampled in the previous
step, whether or not the host has read it yet: the same token the row-by-row path would write, so
the step computes the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from jaxtyping import Int

from cbjax.worker.block_table import BlockTable, empty_writes
from cbjax.worker.sample.sampler import PER_STEP_STAGES
from cbjax.worker.compilation.buckets import Bucket
from cbjax.core.request import Request
from cbjax.core.sched.output import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """What a prepared step leaves for the next one to follow."""

    bucket: Bucket
    requests: tuple[Request, ...]  # its rows' requests, in row order
    sampling_requests: tuple[Request, ...]  # those of its rows that sample, in row order
    starts: Int[np.ndarray, "rows"]  # each row's first computed position
    inputs: Any  # its runner.StepInputs (host numpy arrays, never written after they were packed)
    # A decode step whose every row sampled, none using a sampler stage whose columns change per
    # step (min_tokens holding tokens back, bad_words): the step after it, over the same rows,
    # differs only by one position.
    followable: bool
    # Whether any row scores prompt tokens (prompt_logprobs), or may want logprobs of its sampled
    # token: where neither, reading the step's result skips looking for them.
    scores_prompt: bool
    wants_logprobs: bool


def prepared_step(bucket: Bucket, scheduled: SchedulerOutput, inputs: Any, starts: Int[np.ndarray, "rows"],
                  sampling_requests: list[Request], scores_prompt: bool) -> PreparedStep:
    """Record a step the runner prepared row by row (its rows' starts, the requests of its sampling
    rows, whether any row scores prompt tokens); it synced every row's blocks into the block table."""
    rows = scheduled.scheduled
    followable = (
        scheduled.is_decode_only
        and len(sampling_requests) == len(rows)
        and not any(stage.in_use(inputs.sampling) for stage in PER_STEP_STAGES)
    )
    requests = tuple(row.request for row in rows)
    wants_logprobs = bool(inputs.sampling.wants_logprobs[: len(sampling_requests)].any())
    return PreparedStep(bucket, requests, requests if followable else tuple(sampling_requests), starts,
                        inputs, followable, scores_prompt, wants_logprobs)


def follow(previous: PreparedStep | None, bucket: Bucket, scheduled: SchedulerOutput, table: BlockTable,
           block_size: int, fresh_inputs: Callable[[Bucket], Any],
           slot_of: Callable[[str], int]) -> tuple[Any, PreparedStep] | None:
    """This step's inputs gathered from `previous`'s, if it is a decode step over some of the same
    rows in the same order (those that finished since have left), each one position further on;
    else None (prepare it row by row). `fresh_inputs(bucket)` gives a bucket's zeroed buffers;
    `slot_of(request_id)` a running request's slot. The new blocks' entries are taken from `table`'s
    queue (the device's block table: block_table.py)."""
    rows = scheduled.scheduled
    if previous is None or not previous.followable or scheduled.preempted_request_ids or not scheduled.is_decode_only:
        return None
    requests, _, row_starts, _ = zip(*rows)  # the rows' columns (ScheduledRequest's fields), transposed in C
    num_rows = len(rows)
    starts = np.fromiter(row_starts, np.int32, num_rows)
    if requests == previous.requests:  # identity: a Request compares by id
        source, previous_starts = np.arange(num_rows), previous.starts
    else:  # some left: the others keep their order (running requests are scheduled in admission order)
        row_of = {request: i for i, request in enumerate(previous.requests)}
        source = np.fromiter((row_of.get(request, -1) for request in requests), np.int64, num_rows)
        if (source < 0).any() or (np.diff(source) <= 0).any():
            return None
        previous_starts = previous.starts[source]
    # (both int32: equal bytes are equal values; np.array_equal costs ten times as much)
    if (previous_starts + 1).tobytes() != starts.tobytes():
        return None
    old = previous.inputs
    if bucket == previous.bucket and len(source) == len(previous.requests):
        # The same rows: what stays the same for each request is shared with the previous step's
        # inputs (never written once packed); the columns that move on are copies.
        attn = _replaced(old.attention, seq_lens=old.attention.seq_lens.copy(),
                         slot_mapping=old.attention.slot_mapping.copy(),
                         query_start_loc=old.attention.query_start_loc.copy(),
                         table_writes=empty_writes(len(old.attention.table_writes.slots), table.null_slot))
        new = _replaced(old, token_ids=old.token_ids.copy(), token_sources=old.token_sources.copy(),
                        positions=old.positions.copy(), logits_indices=old.logits_indices.copy(), attention=attn,
                        sampling=_replaced(old.sampling, counters=old.sampling.counters.copy()))
    else:
        # Fewer rows: each copied from its request's row in the previous step, into this bucket's buffers.
        # (Every row of a followable step samples one token: its row, token and sampling row are one index.)
        new = fresh_inputs(bucket)
        for name in ("token_penalty_slots", "token_prompt_lens", "lora_slots"):
            if getattr(old, name) is not None:  # lora_slots: with enable_lora only
                getattr(new, name)[:num_rows] = getattr(old, name)[source]
        for field in dataclasses.fields(old.sampling):
            getattr(new.sampling, field.name)[:num_rows] = getattr(old.sampling, field.name)[source]
        new.attention.table_slots[:num_rows] = old.attention.table_slots[source]
    attn, row_slots = new.attention, new.attention.table_slots[:num_rows]  # the same requests hold the same slots
    # The previous step synced every row's blocks; since then only this step's schedule gave any
    # (a new block every block_size tokens: a few rows a step).
    for request in scheduled.allocated:
        table.sync(slot_of(request.request_id), request.block_ids)
    table.take_writes(attn.table_writes)
    # One position further on, each row's token taken on the device from what its request's row sampled.
    new.token_ids[:num_rows] = 0
    new.token_sources[:num_rows] = source
    new.positions[:num_rows] = starts
    new.logits_indices[:num_rows] = np.arange(num_rows)
    new.sampling.counters[:num_rows] = old.sampling.counters[source] + 1
    attn.seq_lens[:num_rows] = starts + 1
    attn.query_start_loc[: num_rows + 1] = np.arange(num_rows + 1)
    attn.query_start_loc[num_rows + 1 :] = num_rows
    attn.slot_mapping[:num_rows] = slots(table.mirror, row_slots, starts, block_size)
    # (no row of a decode step whose rows all sample scores a prompt token; the rows that asked
    # for logprobs are among those that did in the previous step)
    return new, PreparedStep(bucket, requests, requests, starts, new, True, False, previous.wants_logprobs)


def _replaced(inputs: Any, **changes: Any) -> Any:
    """dataclasses.replace(inputs, **changes) for the frozen, field-only dataclasses of a step's inputs,
    without re-running their __init__ (a third of the time; three a followed step)."""
    new = object.__new__(type(inputs))
    new.__dict__.update(inputs.__dict__, **changes)
    return new


def slots(block_tables: Int[np.ndarray, "slots width"], table_slots: Int[np.ndarray, "tokens"],
          positions: Int[np.ndarray, "tokens"], block_size: int) -> Int[np.ndarray, "tokens"]:
    """Where each token's KV goes in the pool: its block for its position (in the table row
    `table_slots` names), and the offset in it."""
    return block_tables[table_slots, positions // block_size] * block_size + positions % block_size
