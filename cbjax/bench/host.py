"""`cbjax bench host`: the engine's host time per step against a device whose step costs a fixed time.

    cbjax bench host --model checkpoints/smollm2-135m-instruct --result-json bench_results/host.json

The real engine (scheduler, block manager, packing, sampler inputs, the jitted call, output
processing, detokenization, stop strings) runs against the stand-in device of
`standin_device.py`: every step takes `--delays-ms` on the device and nothing on the host's
thread. Requests all start together (prompt: the first --prompt-len tokens of a passage; output:
the passage continued, --output-len tokens, ignore_eos) and are measured over the steps where all
--num-running of them decode. From the device's own timeline, per step:
- wall: from one step's start on the device to the next one's;
- host critical path: from one step's end to the next one's start, the time the device waits
  for the host (in the synchronous loop: all the host's work of a step; hidden work is not in it).
  It includes the wake lag, how late a host thread waiting for a result noticed it was ready
  (the machine's scheduling, not cbjax's work); host work is the critical path without it;
- host CPU: the process's CPU time from one launch to the next, less what waiting took (all the
  host's work of a step, hidden or not): on a shared, loaded machine it moves far less than wall
  times do.
Runs repeat (--repeats) interleaved; `medians` gives each setting's median over the repeats.
Output kinds (--output-kinds): final_only, as LLM.generate asks (no output until a request
finishes); delta, as a server's stream (each step's new tokens and text); cumulative, everything
so far every step (SamplingParams' default).
Variants: greedy alone; + penalties (presence, frequency, repetition: the token history is packed);
+ stop strings (checked on the text every step, never found, so every request runs to the end).
--finish staggered spreads the output lengths evenly over [output_len / 2, 3 * output_len / 2): the
requests leave one after another, as in continuous batching, and every decode step is measured
(from all --num-running of them down to a few), not only those of the whole batch.
--stat-logger attaches `cbjax serve`'s Prometheus stat logger; the steps then come, with --engine-process
off, from the engine-core thread a server runs (ThreadCoreClient), not from this thread's loop.
--prefix-caching-hash-algos sha256 builtin: the prefix cache's block hashes side by side in one engine.
A request hashes a block when it fills one (every --block-size steps), so that cost shows in the mean
host CPU per step (mean_host_cpu_ms_per_step), hardly in the median.
"""

from __future__ import annotations

import argparse
import functools
import queue
import statistics
import time
from typing import Any

from cbjax.bench.common import environment, print_table, write_json
from cbjax.core.kv.prefix_cache import HASH_ALGOS, BlockHasher
from cbjax.entrypoints.cli.args import add_engine_args, engine_options

PASSAGE = (
    "The river begins as snow on the high peaks, melts in the spring sun and gathers in small streams "
    "that run between the rocks. By the time it reaches the valley it is wide and slow, and the farmers "
    "along its banks have used it for as long as anyone can remember: to water the fields, to turn the "
    "mills, to carry grain and timber down to the towns on the coast. In the dry years the water drops "
    "and the old stones of forgotten bridges show again; in the wet years it rises over the meadows and "
    "leaves a layer of fine silt that makes the next harvest rich. Children learn to swim in its quiet "
    "bends, and old men sit on the piers in the evening and talk about the floods of their youth."
)
STOP_STRINGS = ["\nUser:", "</answer>"]  # not in PASSAGE: checked every step, never found
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
VARIANTS = {"greedy": {}, "penalties": PENALTIES, "stop": {"stop": STOP_STRINGS},
            "penalties+stop": {**PENALTIES, "stop": STOP_STRINGS}}
OUTPUT_KINDS = ["final_only", "delta", "cumulative"]
SETTING = ["max_model_len", "variant", "output_kind", "num_running", "finish", "delay_ms", "async_scheduling",
           "engine_process", "prefix_caching_hash_algo"]
TIMES = ["wall_ms_per_step", "host_ms_per_step", "wake_lag_ms_per_step", "host_work_ms_per_step", "host_cpu_ms_per_step",
         "mean_host_cpu_ms_per_step"]
KEYS = [*SETTING, *TIMES, "num_measured_steps", "num_steps", "num_output_tokens"]


def output_lens(output_len: int, num_running: int, finish: str) -> list[int]:
    """Each request's output length: all `output_len` ("together"), or spread evenly over
    [output_len / 2, 3 * output_len / 2) ("staggered", the same mean)."""
    if finish == "together":
        return [output_len] * num_running
    return [output_len // 2 + (i * output_len) // num_running for i in range(num_running)]


def host_params(output_len: int, num_running: int, variant: str, output_kind: str, finish: str) -> list[Any]:
    """Each request's SamplingParams: greedy, ignore_eos, the variant's extras."""
    from cbjax.sampling_params import RequestOutputKind, SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                           output_kind=RequestOutputKind[output_kind.upper()], **VARIANTS[variant])
            for max_tokens in output_lens(output_len, num_running, finish)]


def run_host(engine: Any, timeline: Any, num_running: int, prompt_len: int, output_len: int,
             variant: str, delay_s: float, async_scheduling: str = "on", output_kind: str = "final_only",
             finish: str = "together", hash_algo: str = "sha256") -> dict[str, Any]:
    """One run: `num_running` requests from start to finish; medians over the steps all of them
    decode (finish="staggered": over every decode step)."""
    passage = engine.tokenizer.encode(PASSAGE)
    _start_run(engine, delay_s, async_scheduling, hash_algo, timeline)
    for i, params in enumerate(host_params(output_len, num_running, variant, output_kind, finish)):
        engine.add_request(f"host-{i}", {"prompt_token_ids": passage[:prompt_len]}, params)
    finished = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        finished += [output for output in engine.step() if output.finished]
    elapsed = time.perf_counter() - start
    return measure(timeline.steps, finished, elapsed, num_running, finish) | setting_of(
        engine.config.max_model_len, variant, output_kind, num_running, finish, delay_s, async_scheduling, "off",
        hash_algo, prompt_len, output_len)


def run_host_in_process(core: Any, num_running: int, prompt_len: int, output_len: int, variant: str, delay_s: float,
                        async_scheduling: str = "on", output_kind: str = "final_only",
                        finish: str = "together", hash_algo: str = "sha256") -> dict[str, Any]:
    """run_host with the engine core in its own process (`core`, a ProcessCoreClient whose engine has
    a stand-in device): the steps are the core's, the outputs made in this process."""
    passage = core.tokenizer.encode(PASSAGE)
    core.call(_start_run, delay_s, async_scheduling, hash_algo)
    arrived: queue.SimpleQueue[Any] = queue.SimpleQueue()
    core.add_requests([(f"host-{i}", {"prompt_token_ids": passage[:prompt_len]}, params, arrived.put, 0, None)  # all before a step
                       for i, params in enumerate(host_params(output_len, num_running, variant, output_kind, finish))])
    finished, elapsed = wait_finished(arrived, num_running)
    return measure(core.call(_timeline_steps), finished, elapsed, num_running, finish) | setting_of(
        core.engine_config.max_model_len, variant, output_kind, num_running, finish, delay_s, async_scheduling, "on",
        hash_algo, prompt_len, output_len)


def run_host_in_thread(client: Any, timeline: Any, num_running: int, prompt_len: int, output_len: int, variant: str,
                       delay_s: float, async_scheduling: str = "on", output_kind: str = "final_only",
                       finish: str = "together", hash_algo: str = "sha256") -> dict[str, Any]:
    """run_host through the engine-core thread of `cbjax serve --no-engine-process` (`client`, a
    ThreadCoreClient over a stand-in engine, with its stat loggers): this thread only waits."""
    engine = client.engine
    passage = engine.tokenizer.encode(PASSAGE)
    _start_run(engine, delay_s, async_scheduling, hash_algo, timeline)  # (the core thread is idle: it waits for a command)
    arrived: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for i, params in enumerate(host_params(output_len, num_running, variant, output_kind, finish)):
        client.add_request(f"host-{i}", {"prompt_token_ids": passage[:prompt_len]}, params, arrived.put)
    finished, elapsed = wait_finished(arrived, num_running)
    return measure(timeline.steps, finished, elapsed, num_running, finish) | setting_of(
        engine.config.max_model_len, variant, output_kind, num_running, finish, delay_s, async_scheduling, "off",
        hash_algo, prompt_len, output_len)


def wait_finished(arrived: queue.SimpleQueue, num_running: int) -> tuple[list[Any], float]:
    """The finished outputs of `num_running` requests as they arrive, and the seconds they took."""
    finished = []
    start = time.perf_counter()
    while len(finished) < num_running:
        item = arrived.get(timeout=600)
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            finished.append(item)
    return finished, time.perf_counter() - start


def prometheus_stat_logger(config: Any) -> Any:
    """`cbjax serve`'s stat logger (what its /metrics shows), on a registry of its own."""
    from prometheus_client import CollectorRegistry

    from cbjax.entrypoints.openai.metrics import PrometheusStatLogger

    return PrometheusStatLogger(CollectorRegistry(), "bench", config)


def setting_of(max_model_len: int, variant: str, output_kind: str, num_running: int, finish: str, delay_s: float,
               async_scheduling: str, engine_process: str, hash_algo: str, prompt_len: int,
               output_len: int) -> dict[str, Any]:
    """A run's setting (SETTING's keys), and its request shape."""
    return {"max_model_len": max_model_len, "variant": variant, "output_kind": output_kind, "num_running": num_running,
            "finish": finish, "delay_ms": delay_s * 1e3, "async_scheduling": async_scheduling,
            "engine_process": engine_process, "prefix_caching_hash_algo": hash_algo, "prompt_len": prompt_len,
            "output_len": output_len}


def _start_run(engine: Any, delay_s: float, async_scheduling: str, hash_algo: str, timeline: Any = None) -> None:
    """Set up a run of `engine` (an LLMEngine, or the EngineCore of an engine-core process)."""
    timeline = timeline or engine.standin_timeline
    timeline.delay_s = delay_s
    timeline.steps.clear()
    engine.config.async_scheduling = async_scheduling == "on"
    if engine.block_manager.hasher.algo != hash_algo:  # the cached blocks' hashes are the other algorithm's
        assert engine.reset_prefix_cache(), "a run left blocks held"
        engine.block_manager.hasher = BlockHasher(hash_algo)


def _timeline_steps(engine: Any) -> list[Any]:
    return engine.standin_timeline.steps


def measure(steps: list[Any], finished: list[Any], elapsed: float, num_running: int, finish: str) -> dict[str, Any]:
    """The per-step times of a run's device timeline, over the steps all its requests decode
    (finish="staggered": every decode step)."""
    full = [i for i in range(len(steps) - 1) if steps[i].kind == "decode"
            and (finish == "staggered" or steps[i].num_sampling_rows == num_running)]
    if not full:
        raise SystemExit(f"no step had all {num_running} requests decoding; raise --output-len above the prefill steps")
    host_cpu = [steps[i + 1].launch_cpu - steps[i].launch_cpu - steps[i].wait_cpu for i in full]
    return {
        "wall_ms_per_step": statistics.median(steps[i + 1].start - steps[i].start for i in full) * 1e3,
        "host_ms_per_step": statistics.median(steps[i + 1].start - steps[i].end for i in full) * 1e3,
        "device_ms_per_step": statistics.median(steps[i].end - steps[i].start for i in full) * 1e3,
        "wake_lag_ms_per_step": statistics.median(steps[i].wake_lag for i in full) * 1e3,
        "host_work_ms_per_step": statistics.median(steps[i + 1].start - steps[i].end - steps[i].wake_lag for i in full) * 1e3,
        "host_cpu_ms_per_step": statistics.median(host_cpu) * 1e3,
        # Work every few steps (a block filled: its hash, a new block) is in the mean, not the median.
        "mean_host_cpu_ms_per_step": statistics.mean(host_cpu) * 1e3,
        # A step's tail: the slowest of the measured steps (a full garbage collection lands on one of them).
        "max_wall_ms_per_step": max(steps[i + 1].start - steps[i].start for i in full) * 1e3,
        "num_measured_steps": len(full), "num_steps": len(steps), "num_requests_finished": len(finished),
        # (a DELTA output holds only its last tokens: count them from the metrics)
        "num_output_tokens": sum(output.metrics.num_generation_tokens for output in finished),
        "finish_reasons": sorted({output.outputs[0].finish_reason for output in finished}),
        "elapsed_s": elapsed,
    }


def medians_by_setting(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each setting's median of every time over its repeats, in the order the settings first ran."""
    settings: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        settings.setdefault(tuple(run[k] for k in SETTING), []).append(run)
    return [
        dict(zip(SETTING, setting)) | {k: statistics.median(r[k] for r in group) for k in TIMES}
        for setting, group in settings.items()
    ]


def build_standin_engine(args: argparse.Namespace, max_model_len: int):
    """An engine for `max_model_len` whose device is the stand-in; the pool holds just the workload."""
    from cbjax.bench.standin_device import install_standin
    from cbjax.config import EngineConfig
    from cbjax.engine.llm_engine import LLMEngine

    max_running = max(args.num_running)
    longest = args.prompt_len + max(output_lens(args.output_len, max_running, args.finish))
    blocks_per_request = -(-longest // args.block_size)
    num_kv_blocks = max(max_running * blocks_per_request, -(-max_model_len // args.block_size)) + 1
    options = engine_options(args) | {
        "max_model_len": max_model_len, "max_num_seqs": max(args.max_num_seqs, max_running), "num_kv_blocks": num_kv_blocks,
        "async_scheduling": True,  # each run sets its own
    }
    engine = LLMEngine(EngineConfig(model=args.model, **options), precompile=False, progress=False)
    return engine, install_standin(engine.runner, 0.0, engine.tokenizer.encode(PASSAGE))


def build_standin_core(args: argparse.Namespace, max_model_len: int) -> Any:
    """An engine core process's EngineCore (core/engine_core_proc.run_engine_core calls it): the stand-in's."""
    engine, timeline = build_standin_engine(args, max_model_len)
    engine.core.standin_timeline = timeline
    return engine.core


def cmd_host(args: argparse.Namespace) -> None:
    from cbjax.engine.core_client import ThreadCoreClient
    from cbjax.engine.process_client import ProcessCoreClient

    runs = []
    for max_model_len in args.max_model_lens:
        runners = {}  # by --engine-process: one run of the sweep's settings
        stat_loggers = [prometheus_stat_logger] if args.stat_logger else []
        if "off" in args.engine_process:
            engine, timeline = build_standin_engine(args, max_model_len)
            runners["off"] = functools.partial(run_host, engine, timeline)
            if stat_loggers:  # steps from the core thread a server runs, as the server's
                thread = ThreadCoreClient(engine, [make(engine.config) for make in stat_loggers])
                thread.start()
                runners["off"] = functools.partial(run_host_in_thread, thread, timeline)
        if "on" in args.engine_process:
            core = ProcessCoreClient(build_standin_core, (args, max_model_len), stat_loggers)
            core.start()
            runners["on"] = functools.partial(run_host_in_process, core)
        for run in runners.values():  # warm-up
            run(min(args.num_running), args.prompt_len, args.output_len, "penalties+stop", 0.0)
        hash_algos = args.prefix_caching_hash_algos or [args.prefix_caching_hash_algo]
        sides = [(process, overlap, algo) for process in args.engine_process for overlap in args.async_scheduling
                 for algo in hash_algos]
        for _ in range(args.repeats):
            for variant in args.variants:
                for output_kind in args.output_kinds:
                    for num_running in args.num_running:
                        for delay_ms in args.delays_ms:
                            pair = len(runs) // len(sides)  # A B, then B A: side by side, fairly
                            for process, overlap, algo in sides if pair % 2 == 0 else reversed(sides):
                                runs.append(runners[process](num_running, args.prompt_len, args.output_len, variant,
                                                             delay_ms / 1e3, overlap, output_kind, args.finish, algo))
                                print_table(runs[-1:], KEYS)
        if "on" in runners:
            core.shutdown(timeout=30)
        if "off" in runners and stat_loggers:
            thread.shutdown(timeout=30)
    medians = medians_by_setting(runs)
    print(f"\nmedians over {args.repeats} repeat(s):")
    print_table(medians, [*SETTING, *TIMES])
    result = {"medians": medians, "runs": runs, **environment(args)}
    write_json(args.result_json, result)


def add_host_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("host", help="host time per step of the real engine against a stand-in device of fixed step time")
    add_engine_args(p, variants=True)
    p.add_argument("--num-running", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--max-model-lens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 2.0, 5.0], help="device time per step")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--output-kinds", nargs="+", default=OUTPUT_KINDS[:2], choices=OUTPUT_KINDS,
                   help="what each step's outputs hold: final_only (LLM.generate), delta (a server's stream), cumulative")
    p.add_argument("--finish", choices=["together", "staggered"], default="together",
                   help="together: every request has --output-len tokens; staggered: spread over [1/2, 3/2) of it, "
                        "the batch drains and every decode step is measured")
    p.add_argument("--engine-process", nargs="+", default=["off"], choices=["off", "on"],
                   help="on: the engine core in its own process, outputs made in this one (AsyncLLM's "
                        "engine_process); both: side by side")
    p.add_argument("--prefix-caching-hash-algos", nargs="+", default=None, choices=list(HASH_ALGOS),
                   help="block hashes to run side by side in one engine, the prefix cache emptied when the hash "
                        "changes (default: --prefix-caching-hash-algo's)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats of the whole sweep")
    p.add_argument("--stat-logger", action=argparse.BooleanOptionalAction, default=False,
                   help="attach `cbjax serve`'s Prometheus stat logger (with --engine-process off the steps then "
                        "run in the core thread the server runs); default: none, as LLM.generate")
    p.add_argument("--result-json", default=None)
    # The stand-in never reads the weights or the pool: keep them small (the call still passes them all).
    p.set_defaults(func=cmd_host, dtype="bfloat16", kv_cache_dtype="float16", max_num_seqs=1)
