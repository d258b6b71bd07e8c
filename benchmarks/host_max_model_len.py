"""Does the host's work per step depend on max_model_len? Both lengths side by side in one process.

    python -m benchmarks.host_max_model_len --result-json bench_results/host_max_model_len.json

`cbjax bench host` measures one max_model_len after the other, so a change in the machine's load
between them reads as a difference. Here one stand-in engine per length is built first and the
runs alternate between them (which goes first alternates too); each setting's median host CPU
per step over --repeats, and 8192 / 1024.
"""

from __future__ import annotations

import argparse
import statistics

from cbjax.bench.common import print_table, write_json
from cbjax.bench.host import add_host_parser, build_standin_engine, run_host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--lengths", type=int, nargs=2, default=[1024, 8192])
    p.add_argument("--num-running", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--variants", nargs="+", default=["greedy", "penalties+stop"])
    p.add_argument("--output-kinds", nargs="+", default=["final_only", "delta"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    host_parser = argparse.ArgumentParser()
    add_host_parser(host_parser.add_subparsers())
    host_args = host_parser.parse_args(["host", "--model", args.model, "--num-running", *map(str, args.num_running)])
    engines = [build_standin_engine(host_args, length) for length in args.lengths]
    for engine, timeline in engines:  # warm-up
        run_host(engine, timeline, min(args.num_running), host_args.prompt_len, host_args.output_len, "penalties+stop", 0.0)
    runs, rows = [], []
    for variant in args.variants:
        for kind in args.output_kinds:
            for num_running in args.num_running:
                times: dict[int, list[float]] = {length: [] for length in args.lengths}
                for repeat in range(args.repeats):
                    for engine, timeline in engines if repeat % 2 == 0 else engines[::-1]:
                        run = run_host(engine, timeline, num_running, host_args.prompt_len, host_args.output_len,
                                       variant, 0.0, "on", kind)
                        runs.append(run)
                        times[run["max_model_len"]].append(run["host_cpu_ms_per_step"])
                short, long = (statistics.median(times[length]) for length in args.lengths)
                rows.append({"variant": variant, "output_kind": kind, "num_running": num_running,
                             f"host_cpu_ms_{args.lengths[0]}": short, f"host_cpu_ms_{args.lengths[1]}": long,
                             "ratio": long / short})
                print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, list(rows[0]))
    write_json(args.result_json, {"rows": rows, "runs": runs, "args": vars(args)})


if __name__ == "__main__":
    main()
