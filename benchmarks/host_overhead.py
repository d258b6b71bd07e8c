"""Where a step's time goes on the host, at many running requests.

    python -m benchmarks.host_overhead --model checkpoints/smollm2-135m-instruct --num-requests 256
    python -m benchmarks.host_overhead --model ... --max-model-len 8192 --penalties   # penalty history cost

Part 1 runs the real engine with `--num-requests` requests decoding together
and times each phase of every step by wrapping the engine's own objects:
schedule (Scheduler.schedule), prepare (bucket choice and numpy packing),
device (the runner's dispatch and collect less prepare: the compiled step, transfers included),
update (Scheduler.update) and outputs (detokenization, stop strings, RequestOutput). Host share =
everything but device, over the whole step.

host_cpu_ms is the same host share measured as the main thread's CPU time (time.thread_time),
which other processes competing for the cores do not inflate.

Part 2 times the scheduler alone (schedule + update, no model, no device) at
the same number of running requests, with a fake token per request.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from collections import defaultdict

import numpy as np

from cbjax.entrypoints.cli.args import add_engine_args, engine_options
from cbjax.core.kv.block_manager import BlockManager
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.core.request import Request
from cbjax.core.sched.scheduler import Scheduler
from cbjax.sampling_params import SamplingParams


def timed(times: dict[str, list[float]], name: str, fn):
    """Records fn's wall time under `name` and the calling thread's CPU time under `name`_cpu."""

    def wrapper(*args, **kwargs):
        start, start_cpu = time.perf_counter(), time.thread_time()
        result = fn(*args, **kwargs)
        times[name].append(time.perf_counter() - start)
        times[f"{name}_cpu"].append(time.thread_time() - start_cpu)
        return result

    return wrapper


def engine_phases(engine: LLMEngine, num_requests: int, prompt_len: int, output_len: int, penalties: bool = False) -> dict:
    """Median seconds per phase over the steps where every request is decoding."""
    times: dict[str, list[float]] = defaultdict(list)
    runner, scheduler = engine.runner, engine.scheduler
    runner.prepare = timed(times, "prepare", runner.prepare)
    runner.dispatch = timed(times, "dispatch", runner.dispatch)
    runner.collect = timed(times, "collect", runner.collect)
    schedule = timed(times, "schedule", scheduler.schedule)
    everyone_decoding = []

    def recording_schedule():
        out = schedule()
        everyone_decoding.append(out.is_decode_only and len(out.scheduled) == num_requests)
        return out

    scheduler.schedule = recording_schedule
    scheduler.update = timed(times, "update", scheduler.update)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if penalties:
        params = dataclasses.replace(params, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    for i in range(num_requests):
        prompt = rng.integers(10, engine.model_config.vocab_size, prompt_len).tolist()
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    step = timed(times, "step", engine.step)
    while engine.has_unfinished_requests():
        step()
    full = [i for i, flag in enumerate(everyone_decoding) if flag]
    if not full:
        raise SystemExit("no step had every request decoding; raise --output-len above the prefill steps")
    pick = lambda name: float(np.median([times[name][i] for i in full]))  # noqa: E731
    step, schedule, update, prepare = pick("step"), pick("schedule"), pick("update"), pick("prepare")
    execute = pick("dispatch") + pick("collect")
    device = execute - prepare
    outputs = step - schedule - update - execute
    host = step - device
    # The main thread's CPU time, per step, outside the device call: host work that waiting for a
    # busy CPU (other processes on a shared machine) does not inflate.
    host_cpu = [times["step_cpu"][i] - times["dispatch_cpu"][i] - times["collect_cpu"][i] + times["prepare_cpu"][i]
                for i in full]
    return dict(
        num_running=num_requests, step_ms=step * 1e3, schedule_ms=schedule * 1e3, prepare_ms=prepare * 1e3,
        device_ms=device * 1e3, update_ms=update * 1e3, outputs_ms=outputs * 1e3,
        host_ms=host * 1e3, host_share=host / step, scheduler_share=(schedule + update) / step,
        host_cpu_ms=float(np.median(host_cpu)) * 1e3, prepare_cpu_ms=pick("prepare_cpu") * 1e3,
    )


def scheduler_alone(num_requests: int, prompt_len: int, steps: int, block_size: int = 16) -> dict:
    """schedule() + update() per step with num_requests decoding and nothing else."""
    blocks = num_requests * -(-(prompt_len + steps + 1) // block_size) + 1
    scheduler = Scheduler(
        max_num_seqs=num_requests, max_num_batched_tokens=max(num_requests, prompt_len),
        max_model_len=prompt_len + steps + 1, block_manager=BlockManager(blocks, block_size),
    )
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i in range(num_requests):
        scheduler.add_request(Request(str(i), list(range(3, 3 + prompt_len)), params, eos_token_ids=[2]))
    times = []
    while scheduler.has_unfinished_requests():
        start = time.perf_counter()
        out = scheduler.schedule()
        scheduler.update(out, [5 for row in out.scheduled if row.samples])
        times.append((time.perf_counter() - start, out.is_decode_only))
    decode = [t for t, is_decode in times if is_decode]
    return dict(num_running=num_requests, scheduler_ms_per_step=float(np.median(decode)) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--penalties", action="store_true", help="every request uses presence, frequency and repetition penalties")
    parser.add_argument("--result-json", type=pathlib.Path, default=None)
    parser.set_defaults(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=256)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, **engine_options(args)))
    report = dict(
        engine=engine_phases(engine, args.num_requests, args.prompt_len, args.output_len, args.penalties),
        max_model_len=args.max_model_len,
        penalties=args.penalties,
        scheduler_alone=scheduler_alone(args.num_requests, args.prompt_len, args.output_len),
    )
    print(json.dumps(report, indent=2))
    if args.result_json:
        args.result_json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
