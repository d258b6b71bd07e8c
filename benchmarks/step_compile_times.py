"""Trace-and-lower and compile seconds of each of the engine's step programs, one at a time, no cache (issue 11).

Puts the scanned-layer A/B (benchmarks/scan_layers_ab.py, the model's forward alone) in context:
how long the engine's whole steps (forward, sampler, logprobs, penalties) take to compile when
nothing else competes in this process.

    python benchmarks/step_compile_times.py --out step_compile_times.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

from cbjax.engine.config import EngineConfig
from cbjax.engine.engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--out", default="step_compile_times.json")
    args = parser.parse_args()
    runner = LLMEngine(EngineConfig(model=args.model, compilation_cache_dir=None), precompile=False).runner
    programs = list(dict.fromkeys(runner._step_shapes(runner.buckets).values()))
    rows = []
    for bucket in programs:
        start = time.perf_counter()
        lowered = runner._lower(bucket)
        traced = time.perf_counter() - start
        lowered.compile()
        rows.append({"bucket": [bucket.kind, bucket.num_tokens, bucket.num_reqs], "trace_lower_s": traced,
                     "compile_s": time.perf_counter() - start - traced})
        print(rows[-1], flush=True)
    result = {"load_average": os.getloadavg(), "programs": rows,
              "total_compile_s": sum(r["compile_s"] for r in rows), "total_trace_lower_s": sum(r["trace_lower_s"] for r in rows)}
    with open(args.out, "w") as file:
        json.dump(result, file, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "programs"}))


if __name__ == "__main__":
    main()
