"""Each running request's slot: its row in the state the device keeps per request between steps
(the block table, block_table.py; the penalty history, penalty_state.py). Host-only."""

from __future__ import annotations


class RequestSlots:
    """Which slot each request holds: assigned when the runner first prepares a step of it, given back
    when it finishes, is aborted or is preempted (it then starts again from position 0)."""

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    def slot(self, request_id: str) -> int:
        """The request's slot, assigned on first use."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(
                    f"no request slot left for request {request_id}: all {len(self._slot_of)} are held; "
                    "finished, aborted and preempted requests must release theirs (an engine bug: report it)"
                )
            slot = self._slot_of[request_id] = self._free.pop()
        return slot

    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    def release(self, request_id: str) -> int | None:
        """Free the request's slot, if it holds one; the slot freed."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot
