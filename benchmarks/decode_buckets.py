"""Decode buckets from 8 requests against from 2 on the CPU: whole-engine output tokens/s at few sequences.

    python -m benchmarks.decode_buckets --result-json bench_results/decode_buckets.json

A decode step runs in the smallest compiled bucket that holds its requests, padded rows included, and the
C++ CPU matmuls do each row's multiply-adds. Each engine of --models is built once per --min-decode-reqs
(the engine's CPU_MIN_DECODE_REQS, set before it is built; worker/compilation/buckets.py), and all of them
generate the same requests (--prompt-len random tokens, --output-len greedy tokens, EOS ignored), alternated
over --rounds after a warm-up round, medians. `vs_first` is each engine's rate over the same model's with
the first --min-decode-reqs. The engines' build seconds are printed too, but later builds reuse the earlier
ones' caches; `--cold-starts N` measures start-up instead: N fresh processes per setting, alternated, each
building run.sh's demo engine (the GGUF file, 32 sequences, 1024 tokens, 256 batched) with empty caches and
reporting LLM()'s seconds and its steps' compile seconds (the smaller buckets are more programs to compile);
with `--warm`, from the caches one earlier start of the same setting filled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.quantization import output_tokens_per_s
from cbjax import LLM
from cbjax.bench.common import print_table, write_json
from cbjax.worker import model_runner

# One start in a fresh process: CPU_MIN_DECODE_REQS, the model, and the compilation cache "off" or "auto" from
# argv; prints one JSON line.
COLD_START = """
import json, logging, sys, time
from cbjax.worker import model_runner
model_runner.CPU_MIN_DECODE_REQS = int(sys.argv[1])
compiled = []
class Steps(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("compiled "):
            compiled.append(float(record.getMessage().split(" in ")[1].rstrip(" s")))
logging.getLogger("cbjax.worker.build").addHandler(Steps())
logging.getLogger("cbjax.worker.build").setLevel(logging.INFO)
from cbjax import LLM
start = time.perf_counter()
LLM(sys.argv[2], max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=256,
    compilation_cache_dir=None if sys.argv[3] == "off" else "auto")
print(json.dumps({"llm_s": time.perf_counter() - start, "compile_s": compiled[0] if compiled else None}))
"""

MODELS = {"float32": "checkpoints/smollm2-135m-instruct", "gguf-q4_1": "downloads/SmolLM2-135M-Instruct.Q4_1.gguf"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), help=f"names of {list(MODELS)} or paths")
    p.add_argument("--min-decode-reqs", type=int, nargs="+", default=[8, 2])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold-starts", type=int, default=0, help="measure start-up instead (processes per setting)")
    p.add_argument("--warm", action="store_true", help="with --cold-starts: from caches a first start filled")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    if args.cold_starts:
        return cold_starts(args)
    engines, startup = {}, []
    for min_reqs in args.min_decode_reqs:
        model_runner.CPU_MIN_DECODE_REQS = min_reqs
        for name in args.models:
            start = time.perf_counter()
            llm = LLM(MODELS.get(name, name), max_num_seqs=args.max_num_seqs, max_model_len=512, max_num_batched_tokens=512)
            engines[(name, min_reqs)] = llm
            decode = [b.num_reqs for b in llm.llm_engine.runner.buckets if b.kind == "decode"]
            startup.append({"model": name, "min_decode_reqs": min_reqs, "build_s": time.perf_counter() - start,
                            "decode_buckets": " ".join(map(str, decode))})
    print_table(startup, ["model", "min_decode_reqs", "build_s", "decode_buckets"])
    rows = []
    for num_seqs in args.num_seqs:
        rates = {key: [] for key in engines}
        for round_index in range(args.rounds + 1):  # round 0 warms every engine up and is not counted
            for key, llm in engines.items():
                rate = output_tokens_per_s(llm, num_seqs, args.output_len, args.prompt_len, seed=round_index)
                if round_index:
                    rates[key].append(rate)
        medians = {key: statistics.median(values) for key, values in rates.items()}
        rows += [{"model": name, "num_seqs": num_seqs, "min_decode_reqs": min_reqs, "output_tok_s": medians[(name, min_reqs)],
                  "vs_first": medians[(name, min_reqs)] / medians[(name, args.min_decode_reqs[0])],
                  "rounds": " ".join(f"{r:.0f}" for r in rates[(name, min_reqs)])} for name, min_reqs in engines]
        print_table(rows[-len(engines):], ["model", "num_seqs", "min_decode_reqs", "output_tok_s", "vs_first", "rounds"])
    write_json(args.result_json, {"startup": startup, "speed": rows, "args": vars(args)})


def start(min_reqs: int, cache_dir: str, warm: bool) -> dict:
    """One engine start in a fresh process (COLD_START) with its caches in `cache_dir`: the compile cache on
    where `warm`, off (and JAX's with it) where not."""
    env = {"CBJAX_CACHE_DIR": cache_dir} | ({} if warm else {"CBJAX_DISABLE_COMPILE_CACHE": "1"})
    done = subprocess.run([sys.executable, "-c", COLD_START, str(min_reqs), MODELS["gguf-q4_1"], "auto" if warm else "off"],
                          env=os.environ | env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def cold_starts(args: argparse.Namespace) -> None:
    """Fresh processes, the settings alternated: LLM()'s and its compiles' seconds with empty caches
    (--cold-starts) or, with --warm, from caches one start of the same setting filled (its compile
    seconds are then the step cache's loads)."""
    rows = []
    with tempfile.TemporaryDirectory() as warm_root:
        if args.warm:  # one filling start per setting, not counted
            for min_reqs in args.min_decode_reqs:
                start(min_reqs, f"{warm_root}/{min_reqs}", warm=True)
        for round_index in range(args.cold_starts):
            for min_reqs in args.min_decode_reqs:
                with tempfile.TemporaryDirectory() as empty:
                    cache_dir = f"{warm_root}/{min_reqs}" if args.warm else empty
                    rows.append({"min_decode_reqs": min_reqs, "round": round_index, "warm": args.warm,
                                 **start(min_reqs, cache_dir, args.warm)})
                print(rows[-1], flush=True)
    summary = [{"min_decode_reqs": m, "llm_s": statistics.median(r["llm_s"] for r in rows if r["min_decode_reqs"] == m),
                "compile_s": statistics.median(r["compile_s"] or 0.0 for r in rows if r["min_decode_reqs"] == m)}
               for m in args.min_decode_reqs]
    print_table(summary, ["min_decode_reqs", "llm_s", "compile_s"])
    write_json(args.result_json, {"cold_starts": rows, "medians": summary, "args": vars(args)})


if __name__ == "__main__":
    main()
