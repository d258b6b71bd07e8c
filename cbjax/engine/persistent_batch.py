"""A decode step that follows the previous one row for row: its inputs moved on, not rebuilt.

Most steps of a busy engine are decode steps over the same requests as the step before, each one
position further on. vLLM keeps such a batch in persistent per-row arrays (its InputBatch) and
rewrites only what changed; here the previous step's host inputs are moved on by one position
with whole-column numpy operations on copies, and the rows keep their request slots: only the
rows that gained a block send its entry for the device's block table (block_table.py). The runner's
row-by-row `prepare` builds every other step (and this one's first), and the two must agree:
tests/test_persistent_batch.py checks that they do.

Each row's input token is taken on the device from the previous step's sampled tokens (row i
sampled it there), whether or not the host has read it yet: the same token the row-by-row path
would write, so the step computes the same thing.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np
from jaxtyping import Int

from cbjax.engine.block_table import BlockTable, empty_writes
from cbjax.engine.buckets import Bucket
from cbjax.engine.request import Request
from cbjax.engine.scheduler import SchedulerOutput


_BLOCK_IDS = operator.attrgetter("block_ids")


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """What a prepared step leaves for the next one to follow."""

    bucket: Bucket
    requests: tuple[Request, ...]  # its rows' requests, in row order
    sampling_requests: tuple[Request, ...]  # those of its rows that sample, in row order
    starts: Int[np.ndarray, "rows"]  # each row's first computed position
    block_counts: Int[np.ndarray, "rows"]  # how many blocks each row's block table holds
    inputs: Any  # its runner.StepInputs (host numpy arrays, never written after they were packed)
    # A decode step whose every row sampled, with no token suppressed (min_tokens): the step
    # after it, over the same rows, differs only by one position.
    followable: bool


def prepared_step(bucket: Bucket, scheduled: SchedulerOutput, inputs: Any) -> PreparedStep:
    """Record a step the runner prepared row by row."""
    rows = scheduled.scheduled
    followable = (
        scheduled.is_decode_only
        and all(row.samples for row in rows)
        and not (inputs.sampling.suppress_token_ids[: len(rows)] >= 0).any()
    )
    requests = tuple(row.request for row in rows)
    return PreparedStep(
        bucket,
        requests,
        requests if followable else tuple(row.request for row in rows if row.samples),
        np.fromiter((row.start for row in rows), np.int32, len(rows)),
        np.fromiter(map(len, map(_BLOCK_IDS, requests)), np.int32, len(rows)),
        inputs,
        followable,
    )


def follow(previous: PreparedStep | None, bucket: Bucket, scheduled: SchedulerOutput, table: BlockTable,
           block_size: int) -> tuple[Any, PreparedStep] | None:
    """This step's inputs moved on from `previous`'s, if it is a decode step over the same rows one
    position further on (same bucket); else None (prepare it row by row). The new blocks' entries
    are taken from `table`'s queue (the device's block table: block_table.py)."""
    rows = scheduled.scheduled
    if (
        previous is None
        or not previous.followable
        or bucket != previous.bucket
        or scheduled.preempted_request_ids
        or not scheduled.is_decode_only
    ):
        return None
    requests, _, row_starts, _ = zip(*rows)  # the rows' columns (ScheduledRequest's fields), transposed in C
    if requests != previous.requests:  # identity: a Request compares by id
        return None
    num_rows = len(rows)
    starts = np.fromiter(row_starts, np.int32, num_rows)
    if not np.array_equal(starts, previous.starts + 1):
        return None
    old = previous.inputs
    row_slots = old.attention.table_slots  # the same requests in the same rows hold the same slots
    block_counts = np.fromiter(map(len, map(_BLOCK_IDS, requests)), np.int32, num_rows)
    for i in np.flatnonzero(block_counts != previous.block_counts).tolist():  # a new block every block_size tokens: a few rows a step
        table.sync(int(row_slots[i]), requests[i].block_ids)
    writes = empty_writes(len(old.attention.table_writes.slots), table.null_slot)
    table.take_writes(writes)
    attn = dataclasses.replace(old.attention, seq_lens=old.attention.seq_lens.copy(),
                               slot_mapping=old.attention.slot_mapping.copy(), table_writes=writes)
    positions = old.positions.copy()
    positions[:num_rows] = starts
    attn.seq_lens[:num_rows] = starts + 1
    attn.slot_mapping[:num_rows] = slots(table.mirror, row_slots[:num_rows], starts, block_size)
    token_sources = old.token_sources.copy()
    token_sources[:num_rows] = np.arange(num_rows)  # row i's token: what row i sampled in the previous step
    token_ids = old.token_ids.copy()
    token_ids[:num_rows] = 0
    sampling = dataclasses.replace(old.sampling, counters=old.sampling.counters.copy())
    sampling.counters[:num_rows] += 1
    inputs = dataclasses.replace(old, token_ids=token_ids, token_sources=token_sources, positions=positions,
                                 attention=attn, sampling=sampling)
    return inputs, PreparedStep(bucket, requests, requests, starts, block_counts, inputs, True)


def slots(block_tables: Int[np.ndarray, "slots width"], table_slots: Int[np.ndarray, "tokens"],
          positions: Int[np.ndarray, "tokens"], block_size: int) -> Int[np.ndarray, "tokens"]:
    """Where each token's KV goes in the pool: its block for its position (in the table row
    `table_slots` names), and the offset in it."""
    return block_tables[table_slots, positions // block_size] * block_size + positions % block_size
