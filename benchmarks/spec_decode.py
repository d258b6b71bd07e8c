"""Speculative decoding on SmolLM2, side by side: `python -m benchmarks.spec_decode [--result-json result.json]`.

Two engines of the same options: one without speculation, one with speculative_config (k drafts, its
n-gram proposer swapped for suffix decoding between runs: the proposer is host state, so both methods
share one compiled engine). Workloads:
  copy     chat prompts asking to copy or extract from a passage in the prompt (what prompt lookup is
           for), greedy, at --copy-batches requests in flight (1 and 4: one request at a time, then 4)
  random   random-token prompts, greedy without eos, --random-seqs at once (speculation rarely helps:
           the adaptive switch, disable_by_batch_size, must keep it from costing)
Each run starts from an empty prefix cache (else a method run after another would find its prompts
cached). A warm-up round is run first and not counted; then --rounds rounds, the methods' order rotating
from round to round, so neither order nor the machine's drift favours one. Reported per workload and
method: the median output tokens/s, the median of the rounds' speedups over off, acceptance rate
(accepted / drafted tokens) and mean acceptance length (tokens per verifying step of a request, the bonus
counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cbjax import LLM, SamplingParams
from cbjax.bench.common import print_table, write_json
from cbjax.core.spec.config import SpeculativeConfig
from cbjax.entrypoints.llm import chat_prompt
from cbjax.worker.spec.drafter import Drafter

PASSAGES = [
    "The river rises in the northern hills and runs south for two hundred miles. Along its banks lie old "
    "mill towns, each with a stone bridge, a market square and a church tower that can be seen for miles. "
    "In spring the water is high and brown; in late summer it is clear enough to count the stones.",
    "To reset the router, hold the power button for ten seconds until the light turns orange. Wait for the "
    "light to turn green, then connect to the network named in the label on the back of the device. The "
    "default password is printed below the network name.",
    "Our quarterly report shows revenue of 4.2 million dollars, up eight percent from last year. Costs rose "
    "by three percent, mainly from new hires in the support team. The board approved a budget for two new "
    "offices, one in Lisbon and one in Montreal.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n\ndef variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / "
    "len(values)\n",
]
INSTRUCTIONS = ["Copy the following text exactly, word for word.", "Repeat the text below without changing it."]


def copy_prompts(tokenizer, count: int) -> list[dict]:
    return [chat_prompt(tokenizer, [{"role": "user", "content": f"{INSTRUCTIONS[i % 2]}\n\n{PASSAGES[i % len(PASSAGES)]}"}])
            for i in range(count)]


def random_prompts(count: int, length: int, vocab: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(100, vocab, size=length).tolist()} for _ in range(count)]


def run(llm: LLM, prompts: list[dict], params: SamplingParams, batch: int) -> dict:
    """Output tokens/s with `batch` requests in flight at a time, from an empty prefix cache, and the
    speculation counters' change."""
    llm.reset_prefix_cache()
    before = llm.get_stats()
    start, num_tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[first : first + batch], params, use_tqdm=False)
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    elapsed = time.perf_counter() - start
    after = llm.get_stats()
    result = {"output_tokens": num_tokens, "seconds": elapsed, "output_tok_s": num_tokens / elapsed}
    if "spec_decode_num_drafts" in after:
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        result.update(acceptance_rate=accepted / max(1, drafted), mean_acceptance_length=1 + accepted / max(1, drafts))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None, help="default: speculative_config's")
    parser.add_argument("--copy-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--copy-requests", type=int, default=4, help="copy requests per batch size")
    parser.add_argument("--random-seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds, after one warm-up round")
    parser.add_argument("--result-json", default=None, help="write the result here as JSON")
    args = parser.parse_args()

    options = dict(max_num_seqs=max(32, args.random_seqs, *args.copy_batches), max_model_len=1024,
                   max_num_batched_tokens=256)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": 2, "prompt_lookup_max": 4, "suffix_decoding_max_tree_depth": 24}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engines = {"off": LLM(args.model, **options), "spec": LLM(args.model, **options, speculative_config=spec)}
    tokenizer = engines["off"].get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = [(f"copy@{batch}", copy_prompts(tokenizer, args.copy_requests * batch), greedy, batch)
                 for batch in args.copy_batches]
    workloads.append((f"random@{args.random_seqs}", random_prompts(args.random_seqs, 64, 49152),
                      SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), args.random_seqs))
    methods = ["off", "ngram", "suffix"]
    runs: dict[tuple[str, str], list[dict]] = {}
    for index in range(1 + args.rounds):  # round 0 warms both engines up and is not counted
        order = methods[index % 3:] + methods[: index % 3]
        for name, prompts, params, batch in workloads:
            for method in order:
                engine = engines["off" if method == "off" else "spec"]
                if method != "off":
                    engine.llm_engine.core.speculation.drafter = Drafter(SpeculativeConfig.of({**spec, "method": method}))
                result = run(engine, prompts, params, batch)
                if index > 0:
                    runs.setdefault((name, method), []).append(result)
    rows = []
    for name, *_ in workloads:
        off = runs[(name, "off")]
        for method in methods:
            results = runs[(name, method)]
            speedups = [r["output_tok_s"] / o["output_tok_s"] for r, o in zip(results, off)]
            row = {"workload": name, "method": method, "output_tokens": results[0]["output_tokens"],
                   "output_tok_s": statistics.median(r["output_tok_s"] for r in results),
                   "speedup": statistics.median(speedups), "speedup_rounds": speedups}
            if "acceptance_rate" in results[0]:
                row |= {key: statistics.median(r[key] for r in results) for key in ("acceptance_rate", "mean_acceptance_length")}
            rows.append(row)
    print_table(rows, ["workload", "method", "output_tokens", "output_tok_s", "speedup", "acceptance_rate",
                       "mean_acceptance_length"])
    write_json(args.result_json, {"options": options, "speculative_config": spec, "rows": rows})


if __name__ == "__main__":
    main()
