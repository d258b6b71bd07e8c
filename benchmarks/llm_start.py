"""Seconds of `import cbjax` and of `LLM(...)` with the demo's engine options, in this process.

    python -m benchmarks.llm_start [--model checkpoints/smollm2-135m-instruct] [--result-json FILE]

Prints `import <s> LLM() <s>`. Run in fresh processes, checkouts alternated, to compare warm starts
(`python -m benchmarks.ab --benchmark startup` does); the caches are as earlier runs left them
(CBJAX_CACHE_DIR picks another cache folder).
"""

from __future__ import annotations

import time

start = time.perf_counter()
import argparse  # noqa: E402 - the imports are timed from here

from cbjax import LLM  # noqa: E402

imported = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    built = time.perf_counter()
    LLM(args.model, max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=256, compilation_cache_dir="auto")
    import_s, llm_s = imported - start, time.perf_counter() - built
    print(f"import {import_s:.2f} LLM() {llm_s:.2f}")
    if args.result_json:
        from cbjax.bench.common import write_json

        write_json(args.result_json, {"import_s": import_s, "llm_s": llm_s})


if __name__ == "__main__":
    main()
