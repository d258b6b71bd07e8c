"""float32 against int8, int4, the GGUF file and an fp8 checkpoint served as stored, side by side:
`python -m benchmarks.quantization`.

Speed: decode-heavy requests (short random prompts, `--output-len` tokens each, EOS ignored) at each
`--num-seqs`, output tokens/s of the float32 engine (projections packed for the C++ matmul), the
quantization="int8" and "int4" engines (int8 / 4-bit panels), int8 with quantize_lm_head (the tied
embedding-head int8 too) and the `--gguf` file served as stored (its Q4_1 projections as 4-bit panels, its
Q8_0 embedding-head as int8 groups; for the built-in model, the file the float32 checkpoint was imported from), alternated round by round in one process so that load from other processes falls on
all alike; the median round is reported, with each engine's weight bytes. Quality: perplexity of each
engine on a held-out English text that ships with the OS (default: the GPL-3 and GFDL-1.3 texts of
Debian's common-licenses), scored with prompt_logprobs over consecutive `--window`-token windows (each
window's first token is not scored), and greedy agreement of each engine's continuations with float32's.

With --peer llama.cpp the same prompts also run through llama.cpp on the same GGUF file (llama-cpp-python in
its peer venv, `python -m cbjax.bench.peers --install llamacpp` once; benchmarks/llamacpp_worker.py: the
sequences batched in one context, greedy, EOS ignored), one process per round in the same rotation.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from cbjax import LLM, SamplingParams
from cbjax.bench.common import print_table, write_json

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3"]
GGUF = "downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
# int8-lm-head: quantize_lm_head=True too; fp8: the --fp8 checkpoint (benchmarks/fp8_quantize.py), served as stored
ENGINES = ("float32", "int8", "int8-lm-head", "int4", "gguf-as-stored", "fp8")


LLAMACPP_WORKER = Path(__file__).with_name("llamacpp_worker.py")  # runs in the peer venv: no cbjax there


def random_prompts(num_seqs: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 10_000, size=prompt_len).tolist() for _ in range(num_seqs)]


def output_tokens_per_s(llm: LLM, num_seqs: int, output_len: int, prompt_len: int, seed: int) -> float:
    prompts = [{"prompt_token_ids": ids} for ids in random_prompts(num_seqs, prompt_len, seed)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def llamacpp_tokens_per_s(gguf: str, num_seqs: int, output_len: int, prompt_len: int, seed: int) -> float:
    """The same requests through llama.cpp on the GGUF file, in a process of the peer venv."""
    from cbjax.bench.peers import VENV_ROOT, venv_python

    job = {"gguf": str(Path(gguf).resolve()), "threads": os.cpu_count(),
           "runs": [{"prompts": random_prompts(num_seqs, prompt_len, seed), "output_len": output_len}]}
    path = VENV_ROOT / "runs" / f"quantization-llamacpp-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job))
    done = subprocess.run([str(venv_python("llamacpp")), "-P", str(LLAMACPP_WORKER), str(path)],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"llama.cpp worker exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(lines[-1])["runs"][0]["output_tok_s"]


def perplexity(llm: LLM, token_ids: list[int], window: int) -> tuple[float, int]:
    """exp(mean negative logprob) of every token after the first of each window, and how many were scored."""
    windows = [token_ids[i:i + window] for i in range(0, len(token_ids) - 1, window)]
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows if len(w) > 1],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [entry[token].logprob for w, o in zip(windows, outputs)
                for token, entry in zip(w[1:], o.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    p.add_argument("--gguf", default=GGUF, help="the GGUF file served as stored (the float model's source)")
    # SmolLM2's float32 weights are its Q4_1 file dequantized: groups of 32 land on that grid again (perplexity
    # 18.0, 16/16 greedy continuations as float32's), groups of 64 round it twice (23.3, 0/16).
    p.add_argument("--fp8", default="downloads/smollm2-135m-instruct-fp8",
                   help="an fp8 checkpoint of the float model (python -m benchmarks.fp8_quantize)")
    p.add_argument("--int4", default="int4-g32", help="the int4 engine's quantization= (576 wide: int4-g64 or -g32)")
    p.add_argument("--weights", nargs="+", default=[name for name in ENGINES if name != "fp8"], choices=ENGINES,
                   help="engines to compare (fp8 only when named: its checkpoint is made by benchmarks.fp8_quantize)")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per engine and batch size")
    p.add_argument("--texts", nargs="+", default=TEXTS, help="held-out English text files, concatenated")
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--greedy-tokens", type=int, default=64, help="greedy continuation length for agreement")
    p.add_argument("--peer", choices=["llama.cpp"], help="also run the speed rounds through llama.cpp on --gguf")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    options = dict(max_num_seqs=max(args.num_seqs), max_model_len=args.window + 8, max_num_batched_tokens=512)
    specs = {"float32": (args.model, None), "int8": (args.model, "int8"), "int8-lm-head": (args.model, "int8"),
             "int4": (args.model, args.int4),
             "gguf-as-stored": (args.gguf, None), "fp8": (args.fp8, None)}  # name -> (model, quantization=)
    engines = {}
    for name in dict.fromkeys(["float32", *args.weights]):  # float32 first: the baseline of every ratio
        model, quantization = specs[name]
        start = time.perf_counter()
        engines[name] = LLM(model, quantization=quantization, quantize_lm_head=name == "int8-lm-head", **options)
        print(f"{name}: engine built in {time.perf_counter() - start:.0f} s", flush=True)
    weight_bytes = {name: sum(w.nbytes for w in llm.llm_engine.runner.weights) for name, llm in engines.items()}

    rows = []
    for num_seqs in args.num_seqs:
        runs = {name: [] for name in [*engines, *([args.peer] if args.peer else [])]}
        for round_index in range(args.rounds + 1):  # round 0 warms both up and is not counted
            for name in runs:
                rate = (llamacpp_tokens_per_s(args.gguf, num_seqs, args.output_len, args.prompt_len, seed=round_index)
                        if name == "llama.cpp" else
                        output_tokens_per_s(engines[name], num_seqs, args.output_len, args.prompt_len, seed=round_index))
                if round_index:
                    runs[name].append(rate)
        medians = {name: statistics.median(rates) for name, rates in runs.items()}
        sizes = {**weight_bytes, "llama.cpp": Path(args.gguf).stat().st_size}  # llama.cpp: the whole file
        rows += [{"num_seqs": num_seqs, "weights": name, "output_tok_s": medians[name],
                  "vs_float32": medians[name] / medians["float32"], "weight_bytes_vs_float32":
                  sizes[name] / weight_bytes["float32"], "rounds": " ".join(f"{r:.0f}" for r in runs[name])}
                 for name in runs]
    print_table(rows, ["num_seqs", "weights", "output_tok_s", "vs_float32", "weight_bytes_vs_float32", "rounds"])

    tokenizer = engines["float32"].get_tokenizer()
    text = "\n\n".join(Path(path).read_text() for path in args.texts)
    token_ids = tokenizer.encode(text)
    quality = []
    for name, llm in engines.items():
        value, scored = perplexity(llm, token_ids, args.window)
        quality.append({"weights": name, "perplexity": value, "scored_tokens": scored,
                        "weight_gib": weight_bytes[name] / 2**30})
    for row in quality:
        row["vs_float32"] = row["perplexity"] / quality[0]["perplexity"]
    print_table(quality, ["weights", "perplexity", "vs_float32", "scored_tokens", "weight_gib"])

    prompts = [{"prompt_token_ids": token_ids[i:i + 64]} for i in range(0, 64 * 16, 64)]
    greedy = {name: [list(o.outputs[0].token_ids) for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True), use_tqdm=False)]
        for name, llm in engines.items()}
    agreement = {}
    for name in engines:
        same = sum(a == b for x, y in zip(greedy["float32"], greedy[name]) for a, b in zip(x, y))
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                      for x, y in zip(greedy["float32"], greedy[name])]
        agreement[name] = {"same_tokens": same, "first_diff": first_diff}
        print(f"greedy agreement of {name} with float32: {same}/{len(prompts) * args.greedy_tokens} tokens; "
              f"{first_diff.count(None)}/{len(prompts)} continuations identical; first differing positions {first_diff}")
    write_json(args.result_json, {"speed": rows, "quality": quality, "text_files": args.texts,
                                  "text_tokens": len(token_ids), "greedy_agreement": agreement,
                                  "weight_bytes": weight_bytes, "options": options})


if __name__ == "__main__":
    main()
