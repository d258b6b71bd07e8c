"""`cbjax bench serve`: requests arrive in real time and are driven through the in-process engine.

The loop adds every request whose send time has come (while fewer than
max_concurrency are in flight, like vLLM's semaphore: a request's send time is
when it got a slot), then runs one engine step and stamps each request's new
tokens with the time the step returned. The engine emits at most one token per
request per step, so every token gets its own arrival time and ITLs are the gaps
between steps that advanced the request (vLLM's ITL over streamed chunks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from cbjax.bench.dataset import SyntheticRequest
from cbjax.bench.metrics import RequestTimeline
from cbjax.bench.recorder import StepRecorder
from cbjax.sampling_params import SamplingParams


def run_serve(
    recorder: StepRecorder,
    requests: Sequence[SyntheticRequest],
    send_offsets: Sequence[float],
    max_concurrency: int | None = None,
    label: str = "serve",
) -> tuple[list[RequestTimeline], float]:
    """Serve `requests` arriving at `send_offsets` (s from start); their timelines and the duration."""
    engine = recorder.engine
    recorder.records.clear()
    timelines = [RequestTimeline(prompt_len=r.prompt_len, send_time=float("nan")) for r in requests]
    in_flight: dict[str, int] = {}
    next_index = 0
    start = time.perf_counter()
    while next_index < len(requests) or in_flight:
        now = time.perf_counter() - start
        while (
            next_index < len(requests)
            and send_offsets[next_index] <= now
            and (max_concurrency is None or len(in_flight) < max_concurrency)
        ):
            request, request_id = requests[next_index], f"{label}-{next_index}"
            params = SamplingParams(temperature=1.0, max_tokens=request.output_len, ignore_eos=True, seed=next_index)
            timelines[next_index].send_time = now
            try:
                engine.add_request(request_id, {"prompt_token_ids": request.prompt_token_ids}, params)
                in_flight[request_id] = next_index
            except ValueError:
                timelines[next_index].success = False
            next_index += 1
        if not in_flight:
            if next_index < len(requests):
                time.sleep(max(0.0, send_offsets[next_index] - (time.perf_counter() - start)))
            continue
        outputs = recorder.step()
        now = time.perf_counter() - start
        for output in outputs:
            timeline = timelines[in_flight[output.request_id]]
            num_new = len(output.outputs[0].token_ids) - timeline.output_len
            timeline.token_times.extend([now] * num_new)
            if output.finished:
                del in_flight[output.request_id]
                timeline.success = output.outputs[0].finish_reason != "abort"
    return timelines, time.perf_counter() - start

