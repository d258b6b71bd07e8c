"""Trace-and-lower and compile seconds of each of the engine's step programs, one at a time, no cache (issue 11);
with --options, several sets of XLA compile options side by side, and with --calls, each program's run time.

How long the engine's whole steps (forward, sampler, logprobs, penalties) take to compile when
nothing else competes in this process; the XLA options that decide it (compile_cache.py) are chosen here.

    python -m benchmarks.step_compile_times --out step_compile_times.json
    python -m benchmarks.step_compile_times --options '{}' '{"xla_backend_optimization_level": 1}' \\
        '{"xla_backend_optimization_level": 0}' --calls 7 --out compile_options.json

Each option set compiles every program (wall and process CPU seconds). With --calls N, each
program then runs once more per option set (its first call, which pays one-off costs), then N
more times with the option sets alternating call by call; the median of those N is its step time.
The inputs are the warm-up's: one request attending to one position, the rest padding.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

from cbjax.bench.common import write_json
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.worker.packing import pack


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--options", nargs="+", default=["{}"], help="XLA compile option sets, as JSON objects")
    parser.add_argument("--calls", type=int, default=0, help="also time each program: its first call, then the median of this many")
    parser.add_argument("--out", default="step_compile_times.json")
    args = parser.parse_args()
    runner = LLMEngine(EngineConfig(model=args.model, compilation_cache_dir=None), precompile=False).runner
    programs = list(dict.fromkeys(runner._step_shapes(runner.buckets).values()))
    option_sets = [json.loads(text) for text in args.options]
    results, executables = [], {}
    for index, options in enumerate(option_sets):
        rows = []
        for bucket in programs:
            start = time.perf_counter()
            lowered = runner._lower(bucket)
            traced = time.perf_counter() - start
            wall, cpu = time.perf_counter(), cpu_seconds()
            executables[index, bucket] = lowered.compile(compiler_options=options or None)
            rows.append({"bucket": [bucket.kind, bucket.num_tokens, bucket.num_reqs], "trace_lower_s": traced,
                         "compile_s": time.perf_counter() - wall, "compile_cpu_s": cpu_seconds() - cpu})
            print(options, rows[-1], flush=True)
        results.append({"options": options, "programs": rows, "total_compile_s": sum(r["compile_s"] for r in rows),
                        "total_compile_cpu_s": sum(r["compile_cpu_s"] for r in rows),
                        "total_trace_lower_s": sum(r["trace_lower_s"] for r in rows)})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "programs"}), flush=True)

    def call_ms(index: int, bucket) -> float:
        inputs = runner._host_inputs(bucket)
        inputs.attention.seq_lens[0] = 1
        inputs.attention.query_start_loc[1:] = 1
        start = time.perf_counter()
        runner.kv_pool, runner.penalty_state, runner.last_sampled, runner.block_table, out = executables[index, bucket](
            runner.step_weights, runner.kv_pool, runner.penalty_state, runner.last_sampled, runner.block_table, pack(inputs))
        out.block_until_ready()
        return (time.perf_counter() - start) * 1e3

    if args.calls:
        for bucket in programs:
            first = [call_ms(index, bucket) for index in range(len(option_sets))]
            times: list[list[float]] = [[] for _ in option_sets]
            for _ in range(args.calls):
                for index in range(len(option_sets)):
                    times[index].append(call_ms(index, bucket))
            for index, result in enumerate(results):
                row = result["programs"][programs.index(bucket)]
                row["first_call_ms"], row["step_ms"] = first[index], statistics.median(times[index])
            print(bucket, [(round(f), round(statistics.median(t), 1)) for f, t in zip(first, times)], flush=True)
    write_json(args.out, {"load_average": os.getloadavg(), "calls": args.calls, "results": results})


if __name__ == "__main__":
    main()
