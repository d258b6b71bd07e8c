"""Structured outputs side by side: 64 JSON-schema requests on SmolLM2 through cbjax and vLLM-CPU (its
`guidance` backend: llguidance, the grammar engine cbjax uses, so the same constraints).

    python -m cbjax.bench.peers --install     # once: vLLM-CPU in its venv ($CBJAX_PEER_VENVS)
    python -m benchmarks.structured_outputs --rounds 3 --result-json bench_results/structured_outputs.json

Both engines get the same prompt token ids (the chat template rendered once), greedy, the same
max_tokens, the same schemas with compact JSON (cbjax's llguidance option whitespace_flexible=False;
vLLM: disable_any_whitespace=True), float32, a 1 GiB KV pool each (no preemption), prefix caching on
and reset before each round. Each engine lives in its own process for the whole run (vLLM in the peer
venv); the driver alternates the engines' rounds (A B, then B A) and reports medians, so load from
other work on the machine falls on both.

Each round runs the 64 requests constrained, then plain: no constraint, each request forced to the
length of its constrained answer (ignore_eos), so the plain rounds are the same token work without
masks. Output tokens exclude a final EOS (answer_tokens: vLLM samples the EOS a complete grammar
forces, cbjax stops without it).

Reported: output tokens/s of each engine, constrained and plain, and their ratios; cbjax's host time
per step spent on the masks (filling the constrained rows' bitmasks, and advancing the grammars over
the sampled tokens), by the step's number of constrained rows; whether every output validates
(jsonschema); and the greedy answers compared request by request (equal, or where they first differ
and whether vLLM's top two logprobs there are within 0.02: a near-tie that float32 rounding decides).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from statistics import median

REPO = pathlib.Path(__file__).resolve().parents[1]
NEAR_TIE = 0.02  # a greedy divergence where vLLM's top two logprobs are this close is rounding's call
EOS_TOKEN_ID = 2  # SmolLM2's
MODES = ("constrained", "plain")
ROW_GROUPS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 1 << 30))

# ---- the requests (the driver builds them with cbjax's tokenizer) ----

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "skills"],
               "properties": {"name": {"type": "string", "maxLength": 16},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "city": {"enum": ["Paris", "London", "Tokyo", "Lima", "Cairo"]},
                              "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                         "minItems": 1, "maxItems": 3}}},
    "product": {"type": "object", "additionalProperties": False, "required": ["title", "price", "in_stock", "rating"],
                "properties": {"title": {"type": "string", "maxLength": 24},
                               "price": {"type": "number", "minimum": 0, "maximum": 10000},
                               "in_stock": {"type": "boolean"}, "rating": {"type": "integer", "minimum": 1, "maximum": 5}}},
    "event": {"type": "object", "additionalProperties": False, "required": ["date", "place", "guests"],
              "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                             "place": {"type": "string", "maxLength": 20},
                             "guests": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                        "minItems": 1, "maxItems": 3}}},
    "review": {"type": "object", "additionalProperties": False, "required": ["label", "score"],
               "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                              "score": {"type": "integer", "minimum": 0, "maximum": 10},
                              "reason": {"type": "string", "maxLength": 40}}},
}
QUESTIONS = {
    "person": "Describe a {} as a JSON object with name, age, city and skills.",
    "product": "Describe a {} for sale as a JSON object with title, price, in_stock and rating.",
    "event": "Describe a {} as a JSON object with date, place and guests.",
    "review": "Classify this review as JSON with label and score: 'The {} was not what I expected.'",
}
SUBJECTS = ["teacher", "pilot", "chef", "nurse", "farmer", "painter", "banker", "doctor",
            "lamp", "bicycle", "guitar", "kettle", "wedding", "concert", "meeting", "picnic"]


def build_requests(model: str, num_requests: int) -> list[dict]:
    from cbjax.entrypoints.llm import chat_prompt
    from cbjax.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    requests = []
    for i in range(num_requests):
        kind = list(SCHEMAS)[i % len(SCHEMAS)]
        question = QUESTIONS[kind].format(SUBJECTS[(i // len(SCHEMAS)) % len(SUBJECTS)])
        prompt = chat_prompt(tokenizer, [{"role": "user", "content": question}])
        requests.append({"schema": kind, "prompt_token_ids": prompt["prompt_token_ids"]})
    return requests


# ---- workers: one long-lived process per engine; stdlib imports at module level only ----


def drive(engine, make_params, spec: dict, prefix: str, command: dict, on_step=None) -> dict:
    """Queue every request at t0, step until all finish; elapsed seconds and each request's output.
    command: {"mode": "constrained" | "probe" (constrained, top-2 logprobs) | "plain" (no constraint,
    exactly lengths[i] tokens: the constrained run's token counts)}."""
    requests, mode = spec["requests"], command["mode"]
    logprobs = 2 if mode == "probe" else None
    outputs = {}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = (make_params(None, command["lengths"][i], logprobs) if mode == "plain"
                  else make_params(SCHEMAS[r["schema"]], spec["max_tokens"], logprobs))
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": r["prompt_token_ids"]}, params)
    while len(outputs) < len(requests):
        step_outputs = engine.step()
        if on_step is not None:
            on_step()
        for out in step_outputs:
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    elapsed = time.perf_counter() - start
    done = [outputs[f"{prefix}{i}"] for i in range(len(requests))]
    record = {"elapsed": elapsed, "token_ids": [list(c.token_ids) for c in done], "texts": [c.text for c in done],
              "finish_reasons": [c.finish_reason for c in done]}
    if logprobs:  # per position: [[token_id, logprob], ...] best first
        record["logprobs"] = [[sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda p: -p[1])
                               for step in c.logprobs] for c in done]
    return record


def serve_rounds(engine, reset_prefix_cache, make_params, spec: dict, startup_s: float, step_probe=None) -> None:
    """Announce readiness, then one JSON line per command line (drive's) on stdin until EOF."""
    warm = dict(spec, requests=spec["requests"][:4], max_tokens=8)
    drive(engine, make_params, warm, "warmup-", {"mode": "constrained"})
    drive(engine, make_params, warm, "warmup-plain-", {"mode": "plain", "lengths": [8] * 4})
    print(json.dumps({"ready": True, "startup_s": startup_s}), flush=True)
    for n, line in enumerate(sys.stdin):
        reset_prefix_cache()  # each round starts with the same (cold) cache
        if step_probe is not None:
            step_probe.reset()
        result = drive(engine, make_params, spec, f"r{n}-", json.loads(line), step_probe)
        if step_probe is not None:
            result["mask_steps"] = step_probe.steps
        print(json.dumps(result), flush=True)


class MaskTimer:
    """cbjax's host time on the masks, per step: the constrained rows' bitmask fills (the runner) and the
    grammars' advance over the sampled tokens (the core), timed by wrapping the backend's methods."""

    def __init__(self, grammar_class) -> None:
        self.steps: list[list[float]] = []  # [rows filled, fill ms, advance ms] per step
        self._rows = 0
        self._fill_s = self._advance_s = 0.0
        fill, accept = grammar_class.fill_bitmask, grammar_class.accept_tokens

        def timed_fill(grammar, bitmask, row):
            start = time.perf_counter()
            fill(grammar, bitmask, row)
            self._fill_s += time.perf_counter() - start
            self._rows += 1

        def timed_accept(grammar, token_ids):
            start = time.perf_counter()
            accepted = accept(grammar, token_ids)
            self._advance_s += time.perf_counter() - start
            return accepted

        grammar_class.fill_bitmask, grammar_class.accept_tokens = timed_fill, timed_accept

    def reset(self) -> None:
        self.steps, self._rows, self._fill_s, self._advance_s = [], 0, 0.0, 0.0

    def __call__(self) -> None:  # after each engine step
        if self._rows:
            self.steps.append([self._rows, self._fill_s * 1e3, self._advance_s * 1e3])
        self._rows, self._fill_s, self._advance_s = 0, 0.0, 0.0


def worker_cbjax(spec: dict) -> None:
    from cbjax import LLM, SamplingParams
    from cbjax.core.structured.guidance import GuidanceGrammar
    from cbjax.sampling_params import StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(spec["model"], max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], dtype="float32", compilation_cache_dir=".jax_cache",
              kv_cache_memory_bytes=spec["kv_cache_gib"] << 30)
    startup_s = time.perf_counter() - start

    def make_params(schema, max_tokens, logprobs):  # schema None: a plain request of exactly max_tokens
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=schema is None,
                              structured_outputs=None if schema is None else StructuredOutputsParams(json=schema))

    serve_rounds(llm.llm_engine, llm.reset_prefix_cache, make_params, spec, startup_s, MaskTimer(GuidanceGrammar))


def worker_vllm(spec: dict) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec["kv_cache_gib"])  # read when the engine starts
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(model=spec["hf_dir"], max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], dtype="float32", seed=0,
              structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True})
    startup_s = time.perf_counter() - start

    def make_params(schema, max_tokens, logprobs):  # schema None: a plain request of exactly max_tokens
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=schema is None,
                              structured_outputs=None if schema is None else StructuredOutputsParams(json=schema))

    serve_rounds(llm.llm_engine, llm.reset_prefix_cache, make_params, spec, startup_s)


WORKERS = {"cbjax": worker_cbjax, "vllm": worker_vllm}


# ---- the driver ----


class Engine:
    """One engine's worker process; `run(command)` sends a round and waits for its JSON line."""

    def __init__(self, name: str, spec_path: pathlib.Path, log_path: pathlib.Path) -> None:
        from cbjax.bench.peers import PEER_ENV, venv_python

        python = sys.executable if name == "cbjax" else str(venv_python(name))
        env = os.environ | PEER_ENV | ({"PYTHONPATH": str(REPO)} if name == "cbjax" else {})  # this checkout's cbjax
        self.name, self.log = name, log_path.open("w")
        # -P: the benchmarks folder must not shadow the workers' imports.
        self.process = subprocess.Popen([python, "-P", __file__, "--worker", name, "--spec", str(spec_path)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        cwd=REPO, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name}'s worker exited {self.process.wait()}; its log: {self.log.name}")

    def run(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)
        self.log.close()


def invalid_outputs(record: dict, requests: list[dict]) -> list[str]:
    import jsonschema

    bad = []
    for i, (text, reason) in enumerate(zip(record["texts"], record["finish_reasons"])):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[requests[i]["schema"]])
        except (ValueError, jsonschema.ValidationError) as error:
            bad.append(f"{i} ({reason}): {text!r}: {str(error).splitlines()[0]}")
    return bad


def mask_table(steps: list[list[float]]) -> list[dict]:
    """Median host ms per step on the masks, by the step's constrained row count."""
    table = []
    for low, high in ROW_GROUPS:
        group = [s for s in steps if low <= s[0] <= high]
        if group:
            table.append({"rows": f"{low}-{high}" if high != low else str(low), "steps": len(group),
                          "fill_ms": median([s[1] for s in group]), "advance_ms": median([s[2] for s in group]),
                          "us_per_row": median([(s[1] + s[2]) * 1e3 / s[0] for s in group])})
    return table


def answer_tokens(token_ids: list[int]) -> list[int]:
    """The output without a final EOS: vLLM samples the EOS a complete grammar forces, cbjax stops
    without it (one step fewer), so the same answer is one token longer in vLLM."""
    return token_ids[:-1] if token_ids and token_ids[-1] == EOS_TOKEN_ID else token_ids


def compare_greedy(cbjax_probe: dict, vllm_probe: dict) -> dict:
    """Equal answers (a final EOS aside), and for each difference where it starts and whether it is a
    near-tie in vLLM."""
    equal, near_ties, real = 0, [], []
    for i, (ours, theirs) in enumerate(zip(cbjax_probe["token_ids"], vllm_probe["token_ids"])):
        ours, theirs = answer_tokens(ours), answer_tokens(theirs)
        if ours == theirs:
            equal += 1
            continue
        at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        top = vllm_probe["logprobs"][i][at] if at < len(vllm_probe["logprobs"][i]) else []
        gap = top[0][1] - top[1][1] if len(top) > 1 else None
        (near_ties if gap is not None and gap < NEAR_TIE else real).append({"request": i, "position": at, "gap": gap})
    return {"equal": equal, "near_ties": near_ties, "differences": real}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct", help="cbjax checkpoint")
    parser.add_argument("--hf-dir", default="downloads/smollm2-135m-instruct-hf", help="the same weights for vLLM")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="KV pool of each engine: all requests fit in both")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine, alternated")
    parser.add_argument("--systems", nargs="+", default=["cbjax", "vllm"], choices=list(WORKERS))
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        WORKERS[args.worker](json.loads(pathlib.Path(args.spec).read_text()))
        return

    from cbjax.bench.peers import VENV_ROOT

    spec = {"model": str(REPO / args.model), "hf_dir": str(REPO / args.hf_dir), "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_gib": args.kv_cache_gib,
            "requests": build_requests(args.model, args.num_requests)}
    work = VENV_ROOT / "runs"
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"structured-spec-{os.getpid()}.json"
    spec_path.write_text(json.dumps(spec))
    engines = {}
    for name in args.systems:
        print(f"starting {name} ...", flush=True)
        engines[name] = Engine(name, spec_path, work / f"structured-{name}-{os.getpid()}.log")
    # Untimed first: greedy outputs with top-2 logprobs, compared below; their lengths make the plain rounds.
    probes = {name: engine.run({"mode": "probe"}) for name, engine in engines.items()}
    lengths = [len(answer_tokens(t)) or 1 for t in probes[args.systems[0]]["token_ids"]]
    rounds: dict[str, dict[str, list[dict]]] = {mode: {name: [] for name in engines} for mode in MODES}
    loads = []
    for n in range(args.rounds):
        for mode in MODES:
            for name in list(engines) if n % 2 == 0 else list(engines)[::-1]:  # A B, then B A
                record = engines[name].run({"mode": mode, "lengths": lengths})
                record["output_tokens"] = sum(len(answer_tokens(t)) for t in record["token_ids"])
                record["invalid"] = invalid_outputs(record, spec["requests"]) if mode == "constrained" else []
                rounds[mode][name].append(record)
                print(f"[{n}] {name} {mode}: {record['output_tokens'] / record['elapsed']:.1f} output tok/s, "
                      f"{len(record['invalid'])} invalid", flush=True)
        loads.append(os.getloadavg()[0])
    for engine in engines.values():
        engine.close()

    summary = {"load_average_1min": loads, "engines": {}}
    rate = lambda r: r["output_tokens"] / r["elapsed"]  # noqa: E731
    for name in engines:
        constrained, plain = rounds["constrained"][name], rounds["plain"][name]
        summary["engines"][name] = {
            "startup_s": engines[name].ready["startup_s"],
            "constrained_tok_s": median([rate(r) for r in constrained]),
            "plain_tok_s": median([rate(r) for r in plain]),
            "constrained_over_plain": median([rate(c) / rate(p) for c, p in zip(constrained, plain)]),
            "rounds_constrained_tok_s": [rate(r) for r in constrained],
            "rounds_plain_tok_s": [rate(r) for r in plain],
            "output_tokens": constrained[0]["output_tokens"],
            "invalid": sorted({bad for r in constrained for bad in r["invalid"]}),
            "finish_reasons": {reason: constrained[0]["finish_reasons"].count(reason)
                               for reason in set(constrained[0]["finish_reasons"])},
        }
    if "cbjax" in engines:
        summary["cbjax_mask_host_ms_by_rows"] = mask_table(
            [s for r in rounds["constrained"]["cbjax"] for s in r["mask_steps"]])
    if len(engines) == 2:
        for mode in MODES:
            ratios = [rate(c) / rate(v) for c, v in zip(rounds[mode]["cbjax"], rounds[mode]["vllm"])]
            summary[f"cbjax_over_vllm_{mode}"] = {"rounds": ratios, "median": median(ratios)}
        summary["greedy"] = compare_greedy(probes["cbjax"], probes["vllm"])
    print(json.dumps(summary, indent=1))
    if args.result_json:
        spec_out = {k: v for k, v in spec.items() if k != "requests"} | {"num_requests": args.num_requests,
                                                                          "schemas": SCHEMAS, "rounds": args.rounds}
        pathlib.Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.result_json).write_text(json.dumps({"summary": summary, "spec": spec_out, "probes": probes},
                                                             indent=1))


if __name__ == "__main__":
    main()
