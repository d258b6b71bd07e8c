"""The KV pool's dtype side by side, in one byte budget: `python -m benchmarks.kv_cache_dtypes`.

Engines over the same float32 model, each given the same pool bytes (`--kv-cache-memory-bytes`): the pool in
float32 (the CPU's "auto"), float16, fp8 at scale 1.0 and fp8 with calculate_kv_scales. So fp8 holds twice
float16's tokens and four times float32's. Each `--shapes` entry (sequences x prompt tokens x output tokens,
random prompts, EOS ignored) runs on every engine, alternated round by round in one process so that load from
other processes falls on all alike (round 0 warms up and is not counted); the median round's output tok/s is
reported, with the pool's blocks and the preemptions of the last round. Long prompts make the C++ attention read
the pool at every step; a budget too small for every sequence at once makes the smaller elements hold more of
them. Quality is the tests': tests/engine/test_fp8_kv_smollm2.py, tests/worker/test_kv_scales.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.quantization import random_prompts
from cbjax import LLM, SamplingParams
from cbjax.bench.common import print_table, write_json

ENGINES = {  # name -> LLM options
    "float32": {"kv_cache_dtype": "float32"},
    "float16": {"kv_cache_dtype": "float16"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "fp8-calculated": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
}


def parse_shape(text: str) -> tuple[int, int, int]:
    """"SEQSxPROMPTxOUTPUT", e.g. 16x512x64."""
    num_seqs, prompt_len, output_len = (int(part) for part in text.split("x"))
    return num_seqs, prompt_len, output_len


def run(llm: LLM, num_seqs: int, prompt_len: int, output_len: int, seed: int) -> tuple[float, int]:
    """Output tokens/s of one batch of requests, and how many times they were preempted."""
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts(num_seqs, prompt_len, seed)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return (sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
            sum(o.metrics.num_preemptions for o in outputs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[(16, 32, 128), (16, 512, 32), (48, 256, 32)],
                   help="SEQSxPROMPTxOUTPUT entries (default: 16x32x128 16x512x32 48x256x32)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20,
                   help="every engine's pool budget (default 256 MiB: SmolLM2's float32 pool holds about 5,800 "
                        "tokens, float16 11,600, fp8 23,300)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds per engine and shape")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    longest = max(prompt_len + output_len for _, prompt_len, output_len in args.shapes)
    options = dict(dtype="float32", max_num_seqs=max(num_seqs for num_seqs, _, _ in args.shapes),
                   max_model_len=longest, max_num_batched_tokens=512, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    engines = {}
    for name in args.engines:
        start = time.perf_counter()
        engines[name] = LLM(args.model, **options, **ENGINES[name])
        print(f"{name}: engine built in {time.perf_counter() - start:.0f} s, "
              f"{engines[name].llm_engine.runner.num_blocks} blocks", flush=True)

    rows = []
    for num_seqs, prompt_len, output_len in args.shapes:
        rates = {name: [] for name in engines}
        preempted = {}
        for round_index in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
            for name, llm in engines.items():
                rate, preempted[name] = run(llm, num_seqs, prompt_len, output_len, seed=round_index)
                if round_index:
                    rates[name].append(rate)
        baseline = statistics.median(rates[args.engines[0]])
        rows += [{"shape": f"{num_seqs}x{prompt_len}x{output_len}", "kv_cache": name,
                  "blocks": engines[name].llm_engine.runner.num_blocks, "output_tok_s": statistics.median(rates[name]),
                  f"vs_{args.engines[0]}": statistics.median(rates[name]) / baseline,
                  "preemptions": preempted[name], "rounds": " ".join(f"{r:.0f}" for r in rates[name])}
                 for name in engines]
        print_table(rows[-len(engines):], list(rows[-1]))
    print_table(rows, list(rows[-1]))
    write_json(args.result_json, {"rows": rows, "options": options, "engines": {n: ENGINES[n] for n in engines}})


if __name__ == "__main__":
    main()
