"""Start-up of two checkouts side by side: `LLM()` warm and `cbjax generate --chat` to its first token.

    python benchmarks/startup_ab.py OLD_DIR NEW_DIR [--rounds 3] [--cold-rounds 0] [--out startup_ab.json]

Each checkout runs its own `cbjax.bench.startup` children (fresh processes, its code first on
PYTHONPATH) with its own empty cache folder: one cold `LLM()` and one `cbjax generate --chat` fill
it, then the warm runs alternate old, new, old, new, ... so both see the same machine load.
With --cold-rounds N, N more cold `LLM()` runs each follow, alternated the same way, each in a
new empty cache folder (compilation, weights and kernel caches all empty), with --options' engine
options (JSON) if given.
Prints one JSON object: every run, the medians and new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from cbjax.bench.startup import _run, emit

MODEL = "checkpoints/smollm2-135m-instruct"


def child(tree: str, caches: str, kind: str, options: str = "{}") -> dict:
    """One fresh process of `tree`, run in it (`python -m` puts the working folder first on sys.path):
    LLM() phases (kind "llm") or generate's first token (kind "generate")."""
    env = os.environ | {"CBJAX_CACHE_DIR": caches, "PYTHONPATH": tree}
    for name in ("CBJAX_DISABLE_COMPILE_CACHE", "CBJAX_KERNEL_CACHE", "CBJAX_DISABLE_WEIGHTS_CACHE"):
        env.pop(name, None)
    command = [sys.executable, "-m", "cbjax.bench.startup", "--child", kind, "--model", MODEL, "--options", options]
    stdout, first_byte, total, rss = _run(command + (["--flags="] if kind == "generate" else []), env, cwd=tree)
    record = {"process_s": round(total, 2), "peak_rss_mb": round(rss), "load_average": os.getloadavg()[0]}
    if kind == "generate":
        return record | {"first_token_s": round(first_byte, 2)}
    return record | json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold-rounds", type=int, default=0, help="cold LLM() runs per checkout, alternated")
    parser.add_argument("--options", default="{}", help="LLM options of the cold runs, as JSON (e.g. '{\"max_num_seqs\": 16}')")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    trees = {"old": os.path.realpath(args.old), "new": os.path.realpath(args.new)}
    runs: dict[str, dict[str, list]] = {side: {"llm": [], "generate": []} for side in trees}
    with tempfile.TemporaryDirectory() as old_caches, tempfile.TemporaryDirectory() as new_caches:
        caches = {"old": old_caches, "new": new_caches}
        cold = {side: {kind: child(tree, caches[side], kind) for kind in ("llm", "generate")} for side, tree in trees.items()}
        for _ in range(args.rounds):
            for side, tree in trees.items():
                for kind in ("llm", "generate"):
                    runs[side][kind].append(child(tree, caches[side], kind))
                    print(side, kind, json.dumps(runs[side][kind][-1]), file=sys.stderr)
    for side in trees:
        runs[side]["cold"] = []
    for _ in range(args.cold_rounds):
        for side, tree in trees.items():
            with tempfile.TemporaryDirectory() as empty:
                runs[side]["cold"].append(child(tree, empty, "llm", args.options))
            print(side, "cold", json.dumps(runs[side]["cold"][-1]), file=sys.stderr)
    median = lambda side, kind, field: statistics.median(  # noqa: E731
        r["phases_s"][field] if field in r.get("phases_s", {}) else r[field] for r in runs[side][kind])
    medians = {side: {"llm_warm_s": median(side, "llm", "LLM() total"),
                      "llm_warm_peak_rss_mb": median(side, "llm", "peak_rss_mb"),
                      "generate_first_token_s": median(side, "generate", "first_token_s"),
                      "generate_peak_rss_mb": median(side, "generate", "peak_rss_mb")} for side in trees}
    if args.cold_rounds:
        for side in trees:
            medians[side] |= {"llm_cold_s": median(side, "cold", "LLM() total"),
                              "llm_cold_peak_rss_mb": median(side, "cold", "peak_rss_mb")}
    result = {"trees": trees, "rounds": args.rounds, "cold": cold, "runs": runs, "medians": medians,
              "new_over_old": {k: round(medians["new"][k] / medians["old"][k], 3) for k in medians["new"]}}
    emit(result, args.out)


if __name__ == "__main__":
    main()
