"""The block table kept on the device (cbjax/worker/block_table.py): on random histories of requests
taking slots, growing their blocks and giving slots back, the rows a step gathers equal block tables
built directly from each request's block ids, zero-padded, as the host used to send them; writes beyond
a step's capacity, applied first in chunks, give the same table. And request slots are reused and
their exhaustion named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.worker.block_table import BlockTable, apply_writes, empty_writes, gather_rows, write_capacity
from cbjax.worker.request_slots import RequestSlots

NUM_SLOTS, MAX_BLOCKS, BLOCK_SIZE = 4, 6, 4
apply = jax.jit(apply_writes)
gather = jax.jit(gather_rows, static_argnums=3)


def test_slots_are_reused_after_release_and_exhaustion_is_named():
    slots = RequestSlots(2)
    a, b = slots.slot("a"), slots.slot("b")
    assert {a, b} == {0, 1} and slots.slot("a") == a and slots.num_held == 2
    with pytest.raises(RuntimeError, match="no request slot left for request c: all 2 are held"):
        slots.slot("c")
    assert slots.release("a") == a and slots.release("never-held") is None
    assert slots.slot("c") == a


def test_write_capacity_bounds_what_running_rows_gain():
    # 3 rows computing 1, 4 and 6 tokens from positions 3, 4 and 0 gain 1, 1 and 2 blocks of 4: 4 <= 2 + 3.
    assert write_capacity(11, 3, 4) == 6
    assert write_capacity(256, 256, 16) == 256 + 16


@st.composite
def histories(draw):
    """Steps of (request id, its block count after the step, or 0: it finished or was preempted)."""
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        steps.append(draw(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, MAX_BLOCKS), max_size=NUM_SLOTS)))
    return steps, draw(st.integers(1, 8))


@settings(max_examples=80, deadline=None)
@given(history=histories())
def test_gathered_rows_equal_the_requests_block_tables(history):
    steps, capacity = history
    slots, table = RequestSlots(NUM_SLOTS), BlockTable(NUM_SLOTS, MAX_BLOCKS)
    device = jnp.zeros(table.mirror.shape, jnp.int32)
    rng = np.random.default_rng(len(steps))
    blocks: dict[str, list[int]] = {}  # each live request's block ids, grown step by step
    for step in steps:
        for request_id, count in step.items():
            if count == 0 or count < len(blocks.get(request_id, [])):  # finished or preempted: slot back
                if (slot := slots.release(request_id)) is not None:
                    table.forget(slot)
                blocks.pop(request_id, None)
            if request_id in blocks or count and slots.num_held < NUM_SLOTS:
                slots.slot(request_id)  # held from its first step on
                grown = blocks.setdefault(request_id, [])
                grown += rng.integers(1, 100, count - len(grown)).tolist()
        rows = sorted(blocks)
        for request_id in rows:
            table.sync(slots.slot(request_id), blocks[request_id])
        # Surplus first, in chunks, then the step's own capacity (as ModelRunner.dispatch does).
        step_writes = empty_writes(capacity, NUM_SLOTS)
        table.take_writes(step_writes)
        while table.num_queued:
            chunk = empty_writes(3, NUM_SLOTS)
            table.take_writes(chunk)
            device = apply(device, chunk)
        device = apply(device, step_writes)
        row_slots = np.array([slots.slot(r) for r in rows] + [table.null_slot], np.int32)  # and a padding row
        seq_lens = np.array([len(blocks[r]) * BLOCK_SIZE - rng.integers(0, BLOCK_SIZE) if blocks[r] else 0 for r in rows] + [0], np.int32)
        expected = np.zeros((len(rows) + 1, MAX_BLOCKS), np.int32)
        for i, request_id in enumerate(rows):
            expected[i, : len(blocks[request_id])] = blocks[request_id]
        np.testing.assert_array_equal(np.asarray(gather(device, row_slots, seq_lens, BLOCK_SIZE)), expected)
        for i, request_id in enumerate(rows):  # the host's mirror, which the slot mapping reads
            np.testing.assert_array_equal(table.mirror[row_slots[i], : len(blocks[request_id])], blocks[request_id])


def test_writes_are_queued_once_and_misuse_is_an_error():
    table = BlockTable(NUM_SLOTS, MAX_BLOCKS)
    table.sync(0, [5, 6])
    table.sync(0, [5, 6])  # nothing new
    with pytest.raises(RuntimeError, match="slot 0 holds 2 block ids on the device but its request has 1"):
        table.sync(0, [5])
    with pytest.raises(RuntimeError, match="slot 0 was given back with block-table writes still queued"):
        table.forget(0)
    writes = empty_writes(4, NUM_SLOTS)
    table.take_writes(writes)
    assert (writes.slots.tolist(), writes.columns.tolist(), writes.block_ids.tolist()) == (
        [0, 0, NUM_SLOTS + 1, NUM_SLOTS + 1], [0, 1, 0, 0], [5, 6, 0, 0])  # padding: past the table, dropped
    table.forget(0)
    table.sync(0, [7])  # a new holder writes from the first column
    table.take_writes(writes := empty_writes(4, NUM_SLOTS))
    assert (writes.slots[0], writes.columns[0], writes.block_ids[0]) == (0, 0, 7) and table.num_queued == 0
