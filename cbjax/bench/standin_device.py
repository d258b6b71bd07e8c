"""A stand-in device: the runner's compiled steps replaced by ones whose device time is a fixed delay.

Everything on the host stays real (scheduler, block manager, packing, sampler inputs, the jitted
call with every weight and pool array, output processing). Only what the runner calls changes:
each bucket's step becomes a jitted stand-in with the same arguments and the same packed output,
whose sampled tokens walk through a given text (so detokenization and stop strings see real
words), and whose result is not ready until a modelled device has spent `delay_s` on the step.

The jitted stand-in does no work: it hands the donated state back (aliased, nothing copied), and
the packed result is filled on the host from a zeroed template (a 256-row step: tens of us, about
what reading a result back from a GPU costs). XLA:CPU runs a call's computation inline in the
calling thread (a 256-row stand-in that built its result on the device: 0.21 ms per call, and 0.21
ms with block_until_ready after it), so device work in the stand-in would be counted as the host's;
a GPU would run it on the device while the host goes on.

The device is a queue, like a GPU stream: a step starts when it is launched and the previous step
has finished, and takes `delay_s`. The host thread is free meanwhile and blocks only when it reads
a result, so any engine loop, synchronous or overlapped, is measured as it would run on a GPU.
(A host callback sleeping inside the jitted step would not do: XLA:CPU runs computations with host
callbacks synchronously in the calling thread.)

What it relies on in ModelRunner: `buckets`; `compiled[bucket]` called as
`(weights, *donated_device_state, packed_inputs, grammar_masks) -> (*device_state, packed_result)` and the result
read with `np.asarray`; `input_layouts[bucket]` / `output_layouts[bucket]`, the PackedLayouts of
StepInputs (token_ids, positions, logits_indices, sampling.temperature) and StepOutputs
(sampled.token_ids); and `warm_up()`, which calls every step once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from jaxtyping import Int

from cbjax.worker.compilation.buckets import Bucket
from cbjax.worker.packing import PackedLayout
from cbjax.worker.sample.temperature import PADDING_TEMPERATURE

# A host waiting for a result sleeps in slices this short: on a loaded machine one long sleep wakes
# up milliseconds late (measured: median 0.8 ms, p90 4 ms late, against 0.07 ms in 0.2 ms slices).
_SLEEP_SLICE_S = 2e-4


@dataclasses.dataclass
class DeviceStep:
    """One step on the modelled device (perf_counter seconds)."""

    kind: str  # the bucket's: "decode" | "mixed"
    num_sampling_rows: int  # requests that sample a token in it
    start: float
    end: float
    launch_cpu: float  # the process's CPU time (time.process_time) when the host launched it
    wake_lag: float = 0.0  # how late a host waiting for the result noticed it was ready
    wait_cpu: float = 0.0  # CPU time the host spent waiting for it (sleeping in slices)


class DeviceTimeline:
    """The modelled device: one step at a time, each `delay_s` long, in launch order."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.steps: list[DeviceStep] = []
        self._free_at = 0.0

    def launch(self, kind: str, num_sampling_rows: int) -> DeviceStep:
        """Queue a step now."""
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + self.delay_s
        self.steps.append(DeviceStep(kind, num_sampling_rows, start, self._free_at, time.process_time()))
        return self.steps[-1]


class PendingResult:
    """A step's packed result that the host cannot read before the device has finished the step.

    It answers what an overlapping loop asks of a jax.Array (is_ready, copy_to_host_async,
    block_until_ready, np.asarray).
    """

    def __init__(self, value: np.ndarray, step: DeviceStep):
        self.value, self.step = value, step

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.step.end

    def block_until_ready(self) -> PendingResult:
        if self.is_ready():
            return self
        cpu = time.process_time()
        while (left := self.step.end - time.perf_counter()) > 0:
            time.sleep(min(left, _SLEEP_SLICE_S))
        self.step.wake_lag = time.perf_counter() - self.step.end
        self.step.wait_cpu = time.process_time() - cpu
        return self

    def copy_to_host_async(self) -> None:
        """Nothing to start: the value is already on the host once the device is done."""

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        self.block_until_ready()
        return np.asarray(self.value, dtype)


class StandInStep:
    """Stands in for one bucket's compiled step; compiled on its first call (the runner's warm-up)."""

    def __init__(self, bucket: Bucket, layout: PackedLayout, out_layout: PackedLayout,
                 text_token_ids: Int[np.ndarray, "text"], timeline: DeviceTimeline):
        self.bucket, self.layout, self.out_layout = bucket, layout, out_layout
        self.text_token_ids, self.timeline = text_token_ids, timeline
        self._compiled = None
        # Where the fields it reads lie in the packed inputs, and where the sampled tokens go in the result.
        self._positions = layout.leaf_slice(lambda inputs: inputs.positions)
        self._logits_indices = layout.leaf_slice(lambda inputs: inputs.logits_indices)
        self._temperatures = layout.leaf_slice(lambda inputs: inputs.sampling.temperature)  # padding rows: PADDING_TEMPERATURE
        self._sampled_token_ids = out_layout.leaf_slice(lambda outputs: outputs.sampled.token_ids)
        self._result_template = np.zeros(out_layout.size, np.int32)

    @staticmethod
    def _step(weights: Any, *state_and_inputs: Any) -> tuple[Any, ...]:
        *state, _, _ = state_and_inputs  # (the packed inputs and the grammar masks)
        return tuple(state)  # donated and handed back: no device work

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self._compiled is None:  # everything between the weights and the packed inputs (then the masks) is donated state
            # Compiled ahead, as the runner's steps are: a jax.jit call of uncommitted arrays (the
            # weights) costs about 0.1 ms more per call at SmolLM2's 276 weights, which the engine never pays.
            donated = tuple(range(1, len(args) - 2))
            self._compiled = jax.jit(self._step, donate_argnums=donated).lower(*args).compile()
        state = self._compiled(*args)
        packed = np.asarray(args[-2])
        temperatures = packed[self._temperatures].view(np.float32)
        num_sampling_rows = int(np.count_nonzero(temperatures != PADDING_TEMPERATURE))
        # Each sampling row's next token is the text's token after its position: real words.
        positions = packed[self._positions][packed[self._logits_indices]]
        result = self._result_template.copy()
        result[self._sampled_token_ids] = self.text_token_ids[(positions + 1) % len(self.text_token_ids)]
        step = self.timeline.launch(self.bucket.kind, num_sampling_rows)
        return (*state, PendingResult(result, step))


def install_standin(runner: Any, delay_s: float, text_token_ids: list[int]) -> DeviceTimeline:
    """Replace every compiled step of `runner` by a stand-in, compile them (warm-up); the device's timeline."""
    timeline = DeviceTimeline(delay_s)
    text = np.asarray(text_token_ids, np.int32)
    runner.compiled = {
        bucket: StandInStep(bucket, runner.input_layouts[bucket], runner.output_layouts[bucket], text, timeline)
        for bucket in runner.buckets
    }
    runner.warm_up()
    timeline.steps.clear()
    return timeline
