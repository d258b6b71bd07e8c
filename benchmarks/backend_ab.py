"""Attention backends (and tensor-parallel sizes) side by side: one engine each in one process, interleaved rounds.

    python -m benchmarks.backend_ab --model checkpoints/smollm2-135m-instruct --backends xla cpp \\
        --max-num-seqs 16 --max-num-batched-tokens 256 --max-model-len 512 --dtype bfloat16 \\
        --kv-cache-dtype float16 --compilation-cache-dir .jax_cache --rounds 4

Every round runs the same synthetic requests (section 6's peers workload by default: prompts
and outputs of 16-112 tokens, outputs forced with ignore_eos, temperature 1) through each
engine in turn, queued at once, and times until the last finishes. The first round warms up;
the summary is the median output tokens/s of the others and each engine's ratio to the first.

`--tensor-parallel-sizes 1 3` runs every backend at each size (give the process that many devices,
e.g. XLA_FLAGS=--xla_force_host_platform_device_count=3 on a CPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from cbjax.bench.common import add_dataset_args, synthetic_requests
from cbjax.bench.peers import drive_engine
from cbjax.entrypoints.cli.args import add_engine_args, engine_options
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backend_ab", description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--backends", nargs="+", default=["xla", "cpp"])
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=None, help="default: --tensor-parallel-size")
    add_dataset_args(parser)
    parser.set_defaults(input_len=64, output_len=64, range_ratio=0.75)  # section 6's peers workload
    parser.add_argument("--rounds", type=int, default=4, help="the first is a warm-up, left out of the medians")
    parser.add_argument("--result-json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error(f"--rounds is {args.rounds}; it needs at least 2 (the first is a warm-up)")

    sizes = args.tensor_parallel_sizes or [args.tensor_parallel_size]
    engines = {
        backend if len(sizes) == 1 else f"{backend} tp={tp}": LLMEngine(EngineConfig(
            model=args.model, **(engine_options(args) | {"attention_backend": backend, "tensor_parallel_size": tp})
        ))
        for backend in args.backends
        for tp in sizes
    }
    vocab = next(iter(engines.values())).model_config.vocab_size
    requests = [
        {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
        for r in synthetic_requests(args, vocab)
    ]
    num_output = sum(r["output_len"] for r in requests)

    def params(n: int, i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)

    rounds: dict[str, list[float]] = {backend: [] for backend in engines}
    for round_index in range(args.rounds):
        for backend, engine in engines.items():
            run = drive_engine(engine.add_request, engine.step, requests, params, prefix=f"r{round_index}-")
            rounds[backend].append(num_output / run["elapsed"])
            print(f"round {round_index} {backend}: {rounds[backend][-1]:.1f} output tok/s", flush=True)
    medians = {backend: statistics.median(values[1:]) for backend, values in rounds.items()}
    first = next(iter(engines))
    for backend, value in medians.items():
        print(f"{backend:8s} median {value:7.1f} output tok/s  ({value / medians[first]:.2f}x {first})")
    if args.result_json:
        result = {"output_throughput_rounds": rounds, "median_output_throughput": medians, "args": vars(args) | {"result_json": str(args.result_json)}}
        args.result_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
