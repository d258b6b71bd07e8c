"""The engine in bfloat16 by each matmul path this CPU offers: AMX tiles, vdpbf16ps, XLA:CPU's own dots.

    python -m benchmarks.bf16_paths --result-json bench_results/bf16_paths.json

Each variant is one `cbjax bench throughput` process on the same requests (bf16 weights, float16 pool,
float32 activations), alternated round by round (A B C, then C B A, ...): "amx" is the default where the
CPU has AMX; "vdpbf16ps" the same packed kernel with CBJAX_CPU_AMX=0 (the path of a CPU with AVX512-BF16
but no AMX); "xla-dots" the weights unpacked (--no-cpu-packed-weights), as cbjax served bf16 before the
packed bf16 path. Output tokens/s, medians of the rounds and their ratios to xla-dots, per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from benchmarks.bf16_peers import SHAPES, shape_args
from cbjax.bench.common import write_json

VARIANTS = {"amx": ({}, []), "vdpbf16ps": ({"CBJAX_CPU_AMX": "0"}, []), "xla-dots": ({}, ["--no-cpu-packed-weights"])}


def throughput(shape: str, variant: str, model: str) -> float:
    env, flags = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "run.json"
        subprocess.run(
            [sys.executable, "-m", "cbjax", "bench", "throughput", "--model", model, "--dtype", "bfloat16",
             "--kv-cache-dtype", "float16", *shape_args(shape), "--kv-cache-memory-bytes", str(4 << 30), *flags,
             "--result-json", str(out)],
            check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        return json.loads(out.read_text())["medians"]["continuous"]["output_throughput"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["short-16", "long-64"])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--result-json")
    args = parser.parse_args(argv)
    runs = {shape: {variant: [] for variant in args.variants} for shape in args.shapes}
    for round_index in range(args.rounds):
        order = args.variants if round_index % 2 == 0 else args.variants[::-1]
        for shape in args.shapes:
            for variant in order:
                runs[shape][variant].append(throughput(shape, variant, args.model))
                print(f"round {round_index} {shape} {variant}: {runs[shape][variant][-1]:.1f} out tok/s", flush=True)
    table = {}
    print(f"\n{'shape':<10}{'variant':<12}{'out tok/s':>10}{'vs xla-dots':>13}  rounds")
    for shape, by_variant in runs.items():
        base = statistics.median(by_variant["xla-dots"]) if "xla-dots" in by_variant else None
        for variant, values in by_variant.items():
            median = statistics.median(values)
            table[f"{shape} {variant}"] = {"output_throughput": median, "rounds": values,
                                           "vs_xla_dots": median / base if base else None}
            ratio = f"{median / base:.2f}x" if base else "-"
            print(f"{shape:<10}{variant:<12}{median:>10.1f}{ratio:>13}  {' '.join(f'{v:.0f}' for v in values)}")
    write_json(args.result_json, table)


if __name__ == "__main__":
    main()
