"""Block tables kept on the device: a row per request slot, and only the entries new since the step
before travel with a step.

A step's attention reads each row's block ids, [rows, max_model_len / block_size]. Sent whole with
every step, that table costs host time that grows with max_model_len: 256 rows of 512 blocks (8192
tokens of 16) are 0.5 MB to pack and copy every step, 8 MB at 128K tokens. So the table lives on
the device, one row per request slot (request_slots.py), donated into every step and handed back.
A step carries its rows' slots and the entries written since the step before, (slot, column,
block id). A running request gains at most ceil(n / block_size) blocks in a step that computes n
of its tokens, so a step of T tokens over R rows writes at most T / block_size + R entries (its
`write_capacity`); a request admitted with cached prefix blocks may bring more, and those are
written before the step by a program of their own (`ModelRunner.write_table`). The step gathers
its rows from their slots, zeroed past each row's blocks (the stale entries of a slot's earlier
holder among them), so the kernels read the block tables the host would have sent. The host keeps
a mirror of the device's table, from which it computes the slot mapping.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TableWrites:
    """block_ids[i] goes to (slots[i], columns[i]) of the device's table; a padding entry names a
    slot past the table's end and is dropped."""

    slots: Int[Array, "writes"]
    columns: Int[Array, "writes"]
    block_ids: Int[Array, "writes"]


def write_capacity(num_tokens: int, num_reqs: int, block_size: int) -> int:
    """The most entries the running rows of a step of `num_tokens` tokens over `num_reqs` rows write."""
    return -(-num_tokens // block_size) + num_reqs


class BlockTable:
    """Host side: a mirror of the device's table, how much of each slot's row the device holds, and
    the writes queued for it (host-only, no device work)."""

    def __init__(self, num_slots: int, max_blocks: int):
        self.null_slot = num_slots  # padding rows read this row, never written: all null blocks
        self.mirror = np.zeros((num_slots + 1, max_blocks), np.int32)
        self._num_written = [0] * num_slots
        self._slots: list[int] = []  # the queued writes, as columns
        self._columns: list[int] = []
        self._block_ids: list[int] = []

    @property
    def num_queued(self) -> int:
        return len(self._slots)

    def forget(self, slot: int) -> None:
        """The slot was given back: its next holder writes its row from the first column. (Slots are
        given back between steps, when every queued write has gone out with its step.)"""
        if slot in self._slots:
            raise RuntimeError(f"slot {slot} was given back with block-table writes still queued (an engine bug: report it)")
        self._num_written[slot] = 0

    def sync(self, slot: int, block_ids: list[int]) -> None:
        """Queue the entries of `block_ids` that the slot's row lacks on the device."""
        start, end = self._num_written[slot], len(block_ids)
        if end == start + 1:  # one new block, as a running request gains them: scalar writes (4x cheaper)
            block_id = block_ids[start]
            self.mirror[slot, start] = block_id
            self._slots.append(slot)
            self._columns.append(start)
            self._block_ids.append(block_id)
            self._num_written[slot] = end
        elif end > start:
            new = block_ids[start:]
            self.mirror[slot, start:end] = new
            self._slots += [slot] * (end - start)
            self._columns += range(start, end)
            self._block_ids += new
            self._num_written[slot] = end
        elif end < start:
            raise RuntimeError(
                f"slot {slot} holds {start} block ids on the device but its request has {end}: a request's "
                "blocks only grow while it holds its slot, and a preempted one gives it back (an engine bug: report it)"
            )

    def take_writes(self, writes: TableWrites) -> None:
        """Move up to len(writes.slots) of the queued writes into `writes` (host arrays made by
        empty_writes: what it leaves is padding)."""
        count = min(len(writes.slots), len(self._slots))
        if count:
            for column, queue in zip((writes.slots, writes.columns, writes.block_ids), (self._slots, self._columns, self._block_ids)):
                column[:count] = queue[len(queue) - count :]
                del queue[len(queue) - count :]


def empty_writes(capacity: int, num_slots: int) -> TableWrites:
    """`capacity` padding entries of a table of `num_slots` slots (and its null row): none is written."""
    slots = np.empty(capacity, np.int32)
    slots.fill(num_slots + 1)  # (np.full is Python around these two; this runs every step)
    return TableWrites(slots, np.zeros(capacity, np.int32), np.zeros(capacity, np.int32))


def apply_writes(table: Int[Array, "slots_plus_1 max_blocks"], writes: TableWrites) -> Int[Array, "slots_plus_1 max_blocks"]:
    """Inside a step: the table with `writes` written (padding entries dropped)."""
    return table.at[writes.slots, writes.columns].set(writes.block_ids, mode="drop")


def gather_rows(
    table: Int[Array, "slots_plus_1 max_blocks"], row_slots: Int[Array, "reqs"], seq_lens: Int[Array, "reqs"],
    block_size: int,
) -> Int[Array, "reqs max_blocks"]:
    """Inside a step: each row's block ids, its slot's row zeroed past the blocks its seq_len covers."""
    num_blocks = (seq_lens + block_size - 1) // block_size
    return jnp.where(jnp.arange(table.shape[1]) < num_blocks[:, None], table[row_slots], 0)
