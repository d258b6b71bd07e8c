"""Per-step engine statistics for the benchmarks: bucket occupancy, queue lengths, KV usage and waste.

`StepRecorder(engine).step()` runs `engine.step()` and records what the step did.
It learns the step's bucket by wrapping `engine.runner.prepare` on this engine
instance (the engine is not changed); queue lengths and KV accounting are read
at that moment, after the scheduler allocated the step's blocks.

- useful slot occupancy = useful tokens / bucket token slots. A token is useful
  unless its request is already past its own output length (the static baseline
  runs such rows to the batch's longest request; see `useful_output_len`).
- KV waste = slots allocated to running requests that hold no token: the unused
  tail of each request's last block (and nothing else, since blocks grow step by step).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass
class StepRecord:
    start: float  # perf_counter seconds
    end: float
    kind: str  # bucket kind: "decode" | "mixed"
    bucket_tokens: int  # token slots the compiled step computes
    scheduled_tokens: int
    useful_tokens: int
    num_scheduled: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_allocated_slots: int  # block slots owned by running requests
    kv_token_slots: int  # of those, slots that hold a token after this step

    @property
    def occupancy(self) -> float:
        return self.useful_tokens / self.bucket_tokens

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def kv_waste(self) -> float:
        """Fraction of the running requests' allocated slots that hold no token."""
        if not self.kv_allocated_slots:
            return 0.0
        return 1 - self.kv_token_slots / self.kv_allocated_slots


class StepRecorder:
    def __init__(self, engine: Any):
        self.engine = engine
        self.records: list[StepRecord] = []
        # request id -> output tokens that count as useful (static batching runs rows past it).
        self.useful_output_len: dict[str, int] = {}
        self._pending: dict[str, Any] | None = None
        prepare = engine.runner.prepare

        def recording_prepare(scheduled):
            bucket, inputs = prepare(scheduled)
            self._pending = self._snapshot(bucket, scheduled)
            return bucket, inputs

        engine.runner.prepare = recording_prepare

    def _snapshot(self, bucket: Any, scheduled: Any) -> dict[str, Any]:
        scheduler, block_manager = self.engine.scheduler, self.engine.block_manager
        # Output tokens sampled before this step, those a step still in flight samples included.
        sampled_before = lambda row: row.request.num_output_tokens + row.request.num_output_placeholders - row.samples  # noqa: E731
        useful = sum(
            row.num_new_tokens
            for row in scheduled.scheduled
            if sampled_before(row) < self.useful_output_len.get(row.request.request_id, 1 << 62)
        )
        running = scheduler.running
        return dict(
            kind=bucket.kind,
            bucket_tokens=bucket.num_tokens,
            scheduled_tokens=scheduled.num_scheduled_tokens,
            useful_tokens=useful,
            num_scheduled=len(scheduled.scheduled),
            num_running=len(running),
            num_waiting=scheduler.num_waiting,
            kv_blocks_used=block_manager.num_usable_blocks - block_manager.num_free_blocks,
            kv_blocks_total=block_manager.num_usable_blocks,
            kv_allocated_slots=sum(len(r.block_ids) for r in running) * block_manager.block_size,
            kv_token_slots=sum(r.num_computed_tokens for r in running),  # counted when scheduled
        )

    def step(self) -> list[Any]:
        """engine.step(), recorded if it ran a device step."""
        start = time.perf_counter()
        outputs = self.engine.step()
        if self._pending is not None:
            self.records.append(StepRecord(start=start, end=time.perf_counter(), **self._pending))
            self._pending = None
        return outputs


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _waste(records: list[StepRecord]) -> float:
    """Slot-weighted fraction of the running requests' allocated KV slots that hold no token."""
    allocated = sum(r.kv_allocated_slots for r in records)
    return 1 - sum(r.kv_token_slots for r in records) / allocated if allocated else 0.0


def step_summary(records: list[StepRecord], num_preemptions: int) -> dict[str, Any]:
    """Occupancy, KV usage and waste over a run's steps."""
    if not records:
        return {"num_steps": 0, "num_preemptions": num_preemptions}
    slots = sum(r.bucket_tokens for r in records)
    busy = [r for r in records if r.num_waiting] or records  # steady state: requests queue for a seat or blocks
    return {
        "num_steps": len(records),
        "num_decode_steps": sum(r.kind == "decode" for r in records),
        # Token-weighted over the run, and the plain mean of the per-step ratios.
        "useful_slot_occupancy": sum(r.useful_tokens for r in records) / slots,
        "mean_step_occupancy": sum(r.occupancy for r in records) / len(records),
        # Decode steps only: the classical "rows doing useful work" measure, without prompt tokens.
        "decode_step_occupancy": _mean([r.occupancy for r in records if r.kind == "decode"]),
        "scheduled_slot_occupancy": sum(r.scheduled_tokens for r in records) / slots,
        "peak_kv_usage": max(r.kv_usage for r in records),
        "peak_kv_blocks_used": max(r.kv_blocks_used for r in records),
        "kv_blocks_total": records[0].kv_blocks_total,
        "kv_waste": _waste(records),
        "kv_waste_steady_state": _waste(busy),
        "max_num_running": max(r.num_running for r in records),
        "num_preemptions": num_preemptions,
        "mean_step_ms": 1000 * sum(r.end - r.start for r in records) / len(records),
    }


def step_series(records: list[StepRecord]) -> dict[str, list[Any]]:
    """Per-step columns for plots and the result JSON (times in s from the first step's start)."""
    start = records[0].start if records else 0.0
    return {
        "time_s": [r.end - start for r in records],
        "duration_ms": [1000 * (r.end - r.start) for r in records],
        "kind": [r.kind for r in records],
        "bucket_tokens": [r.bucket_tokens for r in records],
        "scheduled_tokens": [r.scheduled_tokens for r in records],
        "useful_tokens": [r.useful_tokens for r in records],
        "num_running": [r.num_running for r in records],
        "num_waiting": [r.num_waiting for r in records],
        "kv_usage": [r.kv_usage for r in records],
        "kv_waste": [r.kv_waste for r in records],
    }
