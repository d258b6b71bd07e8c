"""Where the host's CPU goes per step against the stand-in device, by phase, at two max_model_lens.

    python -m benchmarks.host_phases --num-running 256 --variant greedy --output-kind final_only

Wraps the engine's own methods (schedule, prepare, launch, collect, update, process_token,
make_output, the whole step) to add up the process's CPU time in each, per engine step, over
--repeats runs alternating between one stand-in engine per max_model_len (`cbjax bench host`'s).
Two tables: the mean per step over whole runs (prompt steps included), and the median per step
over the steady steps, those that launch a decode step of all --num-running requests (what
`cbjax bench host` measures). The phases nest (launch and prepare are inside step; process_token
inside step's recording), so they do not add up to step; what step has beyond them is the rest of
the loop (the engine's bookkeeping, outputs). The wrappers cost some CPU of their own.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from cbjax.bench.common import print_table
from cbjax.bench.host import add_host_parser, build_standin_engine, run_host

PHASES = {"scheduler": ["schedule", "update"], "runner": ["prepare", "launch", "collect"],
          "output_processor": ["process_token", "make_output"], "engine": ["step"]}
NAMES = [name for names in PHASES.values() for name in names]


def time_phases(engine: Any, steps: list[dict[str, float]], clock: Any = time.process_time) -> None:
    """Make each engine step append to `steps` its phases' times by `clock` and the decode rows it launched."""
    current: dict[str, float] = {}
    for owner, names in PHASES.items():
        target = engine if owner == "engine" else getattr(engine, owner)
        for name in names:
            method = getattr(target, name)

            def timed(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
                if _name == "step":
                    current.clear()
                elif _name == "prepare":
                    scheduled = args[0]
                    current["decode_rows"] = len(scheduled.scheduled) if scheduled.is_decode_only else 0
                start = clock()
                try:
                    return _method(*args, **kwargs)
                finally:
                    current[_name] = current.get(_name, 0.0) + clock() - start
                    if _name == "step":
                        steps.append(dict(current))

            setattr(target, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--num-running", type=int, default=256)
    p.add_argument("--variant", default="greedy")
    p.add_argument("--output-kind", default="final_only")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: the process's CPU time (XLA's own threads included); wall: elapsed time")
    args = p.parse_args()
    host_parser = argparse.ArgumentParser()
    add_host_parser(host_parser.add_subparsers())
    host_args = host_parser.parse_args(["host", "--model", args.model, "--num-running", str(args.num_running)])
    engines = {length: build_standin_engine(host_args, length) for length in args.lengths}
    steps: dict[int, list[dict[str, float]]] = {length: [] for length in args.lengths}
    for length, (engine, timeline) in engines.items():
        run_host(engine, timeline, min(16, args.num_running), host_args.prompt_len, host_args.output_len, args.variant, 0.0)  # warm-up
        time_phases(engine, steps[length], time.process_time if args.clock == "cpu" else time.perf_counter)
    for repeat in range(args.repeats):
        for length, (engine, timeline) in (list(engines.items()) if repeat % 2 == 0 else list(engines.items())[::-1]):
            run_host(engine, timeline, args.num_running, host_args.prompt_len, host_args.output_len,
                     args.variant, 0.0, "on", args.output_kind)
    columns = ["max_model_len", *(f"{name}_ms" for name in NAMES)]
    print("mean per step, whole runs:")
    print_table([{"max_model_len": length} | {f"{name}_ms": sum(s.get(name, 0.0) for s in runs) / len(runs) * 1e3
                                              for name in NAMES} for length, runs in steps.items()], columns)
    print(f"median per step, steps launching a decode of all {args.num_running} requests:")
    steady = {length: [s for s in runs if s.get("decode_rows") == args.num_running] for length, runs in steps.items()}
    print_table([{"max_model_len": length, "num_steps": len(runs)}
                 | {f"{name}_ms": statistics.median(s.get(name, 0.0) for s in runs) * 1e3 for name in NAMES}
                 for length, runs in steady.items()], ["max_model_len", "num_steps", *columns[1:]])


if __name__ == "__main__":
    main()
