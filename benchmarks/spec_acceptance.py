"""Suffix vs n-gram draft acceptance on synthetic workloads: `python -m benchmarks.spec_acceptance`.

No model runs: each request's output is known in advance, and a greedy verifier accepts the longest
prefix of a draft that equals the true next tokens, then adds one token of its own (the corrected or
bonus token), as speculative decoding's greedy path does. The `multi_turn` workload is an agent: every
request carries its conversation's history, and its output mixes tool-call templates shared by all
conversations (a few argument tokens change), spans copied from its prompt, and fresh tokens; `random`
repeats nothing. Reported: acceptance rate (accepted / proposed tokens), mean accepted length (accepted
tokens per draft) and tokens per step (output tokens / verification steps, the bound on the speedup).
"""

from __future__ import annotations

import argparse

import numpy as np

from cbjax.bench.common import print_table, write_json
from cbjax.worker.spec.ngram import NgramProposer
from cbjax.worker.spec.suffix import SuffixProposer


def multi_turn_workload(rng, num_conversations: int, turns: int, vocab: int, repetitive: bool):
    """[(prompt, output)] in arrival order; conversations take turns so caches see them interleaved."""
    templates = [rng.integers(0, vocab, size=int(rng.integers(24, 40))) for _ in range(8)]
    histories = [rng.integers(0, vocab, size=32) for _ in range(num_conversations)]
    requests = []
    for _ in range(turns):
        for c in range(num_conversations):
            prompt = np.concatenate([histories[c], rng.integers(0, vocab, size=16)])
            segments = []
            for _ in range(int(rng.integers(3, 6))):
                kind = rng.random() if repetitive else 1.0
                if kind < 0.6:
                    call = templates[int(rng.integers(len(templates)))].copy()
                    call[rng.integers(len(call), size=2)] = rng.integers(0, vocab, size=2)  # arguments
                    segments.append(call)
                elif kind < 0.8:
                    start = int(rng.integers(len(prompt) - 12))
                    segments.append(prompt[start:start + 12])
                else:
                    segments.append(rng.integers(0, vocab, size=12))
            output = np.concatenate(segments)
            requests.append((prompt, output))
            histories[c] = np.concatenate([prompt, output])
    return requests


def accepted_prefix(draft: np.ndarray, truth: np.ndarray) -> int:
    n = min(len(draft), len(truth))
    mismatch = np.flatnonzero(draft[:n] != truth[:n])
    return int(mismatch[0]) if mismatch.size else n


def replay(proposer, requests) -> dict:
    """Greedy-verifies every request's output against the proposer's drafts; sums the counts."""
    stats = dict(steps=0, drafts=0, draft_tokens=0, accepted=0, output_tokens=0)
    stateful = isinstance(proposer, SuffixProposer)
    for i, (prompt, output) in enumerate(requests):
        if stateful:
            proposer.start_request(i, prompt)
        tokens, done = list(prompt), 0
        while done < len(output):
            draft = proposer.propose_request(i) if stateful else proposer.propose(np.array(tokens))
            accepted = accepted_prefix(draft, output[done:])
            step_tokens = output[done:done + accepted + 1]  # the verifier's own token comes with them
            stats["steps"] += 1
            stats["drafts"] += int(len(draft) > 0)
            stats["draft_tokens"] += len(draft)
            stats["accepted"] += accepted
            done += len(step_tokens)
            tokens.extend(step_tokens.tolist())
            if stateful:
                proposer.extend(i, step_tokens)
        stats["output_tokens"] += len(output)
        if stateful:
            proposer.finish_request(i)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens for both methods")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    methods = {
        f"ngram k={args.k} lookup 2-4": lambda: NgramProposer(args.k, 2, 4),
        f"suffix k={args.k}": lambda: SuffixProposer(num_speculative_tokens=args.k),
        "suffix vLLM defaults (k=24)": lambda: SuffixProposer(),
    }
    rows = []
    for workload, repetitive in (("multi_turn", True), ("random", False)):
        requests = multi_turn_workload(np.random.default_rng(args.seed), args.conversations, args.turns,
                                       args.vocab, repetitive)
        for method, make in methods.items():
            s = replay(make(), requests)
            rows.append(dict(workload=workload, method=method, drafts=s["drafts"],
                             draft_tokens=s["draft_tokens"], accepted=s["accepted"],
                             acceptance_rate=s["accepted"] / max(s["draft_tokens"], 1),
                             mean_accepted_len=s["accepted"] / max(s["drafts"], 1),
                             tokens_per_step=s["output_tokens"] / s["steps"]))
    print_table(rows, list(rows[0]))
    write_json(args.result_json, dict(args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
