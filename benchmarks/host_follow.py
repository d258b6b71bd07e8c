"""Host time per step with the persistent batch on and off: followed steps against row-by-row ones.

    PYTHONPATH=. python -m benchmarks.host_follow --num-running 256 --rounds 2

One stand-in engine (`cbjax bench host`'s) runs the same workload with
`ModelRunner.follow_decode_steps` on and off, alternating; prints the host critical path per step
(0 ms device) of each run. Off, every step is prepared row by row (cbjax/worker/model_runner.py `prepare`).
"""

from __future__ import annotations

import argparse

from cbjax.bench.host import add_host_parser, build_standin_engine, run_host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--num-running", type=int, default=256)
    p.add_argument("--variant", default="greedy")
    p.add_argument("--output-kind", default="final_only")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    host_parser = argparse.ArgumentParser()
    add_host_parser(host_parser.add_subparsers())
    host_args = host_parser.parse_args(["host", "--model", args.model, "--num-running", str(args.num_running)])
    engine, timeline = build_standin_engine(host_args, 1024)
    run_host(engine, timeline, args.num_running, host_args.prompt_len, host_args.output_len, args.variant, 0.0)  # warm-up
    for _ in range(args.rounds):
        for follow in (True, False):
            engine.runner.follow_decode_steps = follow
            run = run_host(engine, timeline, args.num_running, host_args.prompt_len, host_args.output_len,
                           args.variant, 0.0, "on", args.output_kind)
            print(f"follow_decode_steps={follow}: host critical path {run['host_ms_per_step']:.3f} ms a step", flush=True)


if __name__ == "__main__":
    main()
