"""Soak `cbjax serve` under overload on loopback (issue 35): thousands of requests at about twice the
engine's capacity, streamed and not, `n` up to 4, stop strings, clients that leave mid-stream, aborts
(a client timeout), invalid requests in between; writes one JSON object per core mode.

    python -m benchmarks.soak_server --result-json bench_results/soak_server.json

Every greedy prompt's continuation is computed once alone first; under load a greedy request must
return exactly it (cut at its stop string), in every choice, so a request that got another's text,
lost a chunk or its final chunk ([DONE] after a finish_reason for every choice index) is a failure.
After the run: /health answers, the server serves a greedy request, no request is running or
waiting and no KV block is held (/metrics), and peak RSS stayed within --rss-growth of its value
after warm-up. Exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_process import ServerProcess  # noqa: E402

PROMPTS = [
    "The quick brown fox", "Once upon a time", "Paris is the capital of", "def add(a, b):",
    "Unicode: café, naïve,", "The capital of Germany is", "There was a tiny model", "Numbers: 1, 2, 3,",
]
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
# (body, statuses it may get): each one a mistake a client makes; none may cost the server anything.
INVALID_BODIES = [
    ({"prompt": [10**9]}, {400}),
    ({"prompt": "x", "n": 0}, {400}),
    ({"prompt": "x", "n": 1_000_000}, {400}),
    ({"prompt": "x", "max_tokens": 10**6}, {400}),
    ({"prompt": "x", "stop_token_ids": [8589934592]}, {400}),
    ({"prompt": "x", "top_k": 10**300, "max_tokens": 2}, {200, 400}),
    ({"prompt": "x", "temperature": -1}, {400}),
    ({"prompt": "x", "model": "not-this-model"}, {404}),
    ({"prompt": []}, {400}),
    ({"prompt": ["x"] * 64, "n": 4}, {400}),
    ({"prompt": "x", "stop": ["a"] * 100}, {400}),
    ({"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a+"}, {400}),  # two constraints
    ({"prompt": "x", "stream_options": {"include_usage": True}}, {400}),
    ({"messages": []}, {400}),
    ({"messages": [{"role": "user"}], "max_tokens": "many"}, {400}),
    ("{not json", {400}),
]


def rss_bytes(pid: int) -> int:
    """The server's resident memory, its engine-core child (--engine-process) included."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


async def idle_gauges(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    """IDLE_GAUGES from /metrics once all are zero (or as they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        gauges = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name in IDLE_GAUGES}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.1)


def greedy_body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def expected_text(reference: str, stop: str | None) -> tuple[str, str]:
    """(text, finish_reason) of a greedy request whose continuation alone is `reference`."""
    if stop is not None and stop in reference:
        return reference[: reference.index(stop)], "stop"
    return reference, "length"


def plan_request(rng: random.Random, references: dict[str, str], max_tokens: int) -> dict:
    """One request: its kind, route, body and what its answer must be."""
    kind = rng.choices(["greedy", "sampled", "chat", "disconnect", "abort", "invalid"], [35, 15, 10, 15, 10, 15])[0]
    if kind == "invalid":
        body, statuses = rng.choice(INVALID_BODIES)
        route = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        return {"kind": kind, "route": route, "body": body, "statuses": statuses, "stream": False}
    stream = kind == "disconnect" or (kind != "abort" and rng.random() < 0.5)
    prompt = rng.choice(PROMPTS)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": rng.randrange(2**31),
            "n": rng.randint(1, 4), "stream": stream, "stop": rng.choice([None, "e", " t", "\n"])}
    plan = {"kind": kind, "route": "/v1/completions", "body": body, "statuses": {200}, "stream": stream}
    if kind == "greedy":
        reference = references[prompt]
        stop = None
        if rng.random() < 0.5 and len(reference) > 2:
            start = rng.randrange(len(reference) - 2)
            stop = reference[start: start + rng.randint(1, 3)]
        body |= greedy_body(prompt, max_tokens) | {"stop": stop}
        plan["expect"] = expected_text(reference, stop)
    elif kind == "chat":
        body.pop("prompt")
        body["messages"] = [{"role": "user", "content": prompt}]
        plan["route"] = "/v1/chat/completions"
    elif kind == "disconnect":
        plan["leave_after_chunks"] = rng.randint(1, 3)
    elif kind == "abort":
        plan["client_timeout_s"] = rng.uniform(0.002, 0.1)
    return plan


def choices_of(chunks: list[dict]) -> tuple[dict[int, str], dict[int, str], list[str]]:
    """(text, finish_reason) by choice index from a response's chunks, and what is wrong with their order."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    problems = []
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            index = choice["index"]
            if index in finishes:
                problems.append(f"choice {index} got more after its finish_reason {finishes[index]!r}")
            delta = choice.get("delta") or choice.get("message") or {}
            texts[index] = texts.get(index, "") + (choice.get("text") or delta.get("content") or "")
            if choice.get("finish_reason") is not None:
                finishes[index] = choice["finish_reason"]
    return texts, finishes, problems


def check_answer(plan: dict, chunks: list[dict]) -> list[str]:
    """Every choice index present and finished; a greedy one equal to its reference."""
    n = plan["body"]["n"]
    texts, finishes, problems = choices_of(chunks)
    if set(finishes) != set(range(n)):
        problems.append(f"finish_reason for choices {sorted(finishes)}, expected 0..{n - 1}")
    if "expect" in plan:
        text, finish = plan["expect"]
        for index in range(n):
            if (texts.get(index), finishes.get(index)) != (text, finish):
                problems.append(f"choice {index}: {texts.get(index)!r} ({finishes.get(index)}), "
                                f"expected {text!r} ({finish})")
    return problems


async def sse_data(response: httpx.Response):
    """The `data:` fields of an event stream. Lines end at CR or LF only (the SSE spec), not at every
    line break str.splitlines knows (httpx's aiter_lines), which U+2028 or U+0085 in a JSON string would split."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            if line.startswith("data: "):
                yield line[len("data: "):]


async def read_stream(response: httpx.Response, plan: dict) -> tuple[list[dict], bool, list[str]]:
    """The chunks of an event stream, whether [DONE] ended it, and error events; a planned
    disconnect returns after its chunks."""
    chunks, errors = [], []
    async for data in sse_data(response):
        if data == "[DONE]":
            return chunks, True, errors
        try:
            chunk = json.loads(data)
        except ValueError:
            errors.append(f"an event that is not JSON: {data[:300]!r}")
            continue
        if "error" in chunk:
            errors.append(f"error event: {chunk['error'].get('message')}")
            continue
        chunks.append(chunk)
        if len(chunks) >= plan.get("leave_after_chunks", len(chunks) + 1):
            return chunks, False, errors
    return chunks, False, errors


async def send(client: httpx.AsyncClient, plan: dict) -> dict:
    """Send one planned request; its outcome: status (or what happened instead) and the failures found."""
    body = plan["body"]
    request = client.build_request("POST", plan["route"], **(
        {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    ))
    try:
        response = await asyncio.wait_for(client.send(request, stream=True), plan.get("client_timeout_s"))
    except TimeoutError:
        return {"kind": plan["kind"], "status": "aborted", "failures": []}
    except httpx.HTTPError as error:
        return {"kind": plan["kind"], "status": "connection error", "failures": [f"{type(error).__name__}: {error}"]}
    try:
        status, failures = await read_answer(response, plan)
    except httpx.HTTPError as error:
        status, failures = "connection error", [f"{type(error).__name__} while reading: {error}"]
    finally:
        await response.aclose()
    return {"kind": plan["kind"], "status": status, "failures": failures}


async def read_answer(response: httpx.Response, plan: dict) -> tuple[int | str, list[str]]:
    """(status, failures) of a response whose headers came."""
    status = response.status_code
    if status == 503 and "retry-after" in response.headers:  # the overload gate, deliberate
        return status, []
    if status not in plan["statuses"]:
        await response.aread()
        return status, [f"status {status} (expected {sorted(plan['statuses'])}): {response.text[:300]}"]
    if status != 200 or plan["kind"] == "invalid":
        return status, []
    if not plan["stream"]:
        await response.aread()
        return status, check_answer(plan, [response.json()])
    chunks, done, failures = await read_stream(response, plan)
    if "leave_after_chunks" in plan and not done:
        return "disconnected", failures
    if not done:
        failures.append("the stream ended without data: [DONE]")
    return status, failures + check_answer(plan, chunks)


def seats(plan: dict) -> int:
    """Sequences a request asks the engine for (an invalid one none, but it holds a connection)."""
    return 1 if plan["kind"] == "invalid" else plan["body"]["n"]


class SequenceGate:
    """At most `capacity` sequences (a request counts its `n`) in flight; one request takes its seats at once."""

    def __init__(self, capacity: int):
        self.seats, self.taking = asyncio.Semaphore(capacity), asyncio.Lock()

    async def run(self, n: int, work):
        async with self.taking:  # one taker at a time: no two requests hold part of what each needs
            for _ in range(n):
                await self.seats.acquire()
        try:
            return await work
        finally:
            for _ in range(n):
                self.seats.release()


async def load(client: httpx.AsyncClient, plans: list[dict], capacity: int, pid: int, deadline_s: float) -> tuple[list[dict], int]:
    """Send `plans` keeping `capacity` sequences in flight; their outcomes (a request unanswered at the
    deadline is cancelled and fails) and the peak RSS seen meanwhile."""
    gate = SequenceGate(capacity)
    tasks = [asyncio.create_task(gate.run(seats(p), send(client, p))) for p in plans]
    deadline, peak = time.monotonic() + deadline_s, rss_bytes(pid)
    while not all(task.done() for task in tasks) and time.monotonic() < deadline:
        peak = max(peak, rss_bytes(pid))
        await asyncio.wait(tasks, timeout=0.25)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    unanswered = {"status": "unanswered", "failures": [f"no answer within the {deadline_s:.0f} s deadline"]}
    return [task.result() if not task.cancelled() else {"kind": plan["kind"], **unanswered}
            for task, plan in zip(tasks, plans)], peak


async def after_run(client: httpx.AsyncClient, prompt: str, reference: str, max_tokens: int) -> tuple[dict, list[str]]:
    """The server answers /health, holds nothing (/metrics) and still gives `prompt` its greedy `reference`."""
    try:
        gauges = await idle_gauges(client, timeout=10)
        health = (await client.get("/health", timeout=10)).status_code
        text = (await client.post("/v1/completions", json=greedy_body(prompt, max_tokens), timeout=30)).json()["choices"][0]["text"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        return {}, [f"after the run the server did not answer: {type(error).__name__}: {error}"]
    failures = [f"not idle after the run: {gauges}"] if any(gauges.values()) else []
    if health != 200:
        failures.append(f"/health answered {health} after the run")
    if text != reference:
        failures.append(f"greedy after the run: {text!r}, alone {reference!r}")
    return {"gauges_after": gauges, "health_after": health}, failures


async def soak(server: ServerProcess, args: argparse.Namespace) -> dict:
    rng, pid = random.Random(args.seed), server.process.pid
    limits = httpx.Limits(max_connections=round(2 * args.load_factor * args.max_num_seqs) + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(30), limits=limits) as client:
        references = {}
        for prompt in PROMPTS:  # alone, one at a time: the continuations the loaded run must reproduce
            answer = (await client.post("/v1/completions", json=greedy_body(prompt, args.max_tokens))).json()
            references[prompt] = answer["choices"][0]["text"]
        capacity = round(args.load_factor * args.max_num_seqs)  # sequences in flight: twice what the engine runs, by default
        warmup = [plan_request(rng, references, args.max_tokens) for _ in range(4 * args.max_num_seqs)]
        await load(client, warmup, capacity, pid, args.deadline_s)
        rss_after_warmup = rss_bytes(pid)
        plans = [plan_request(rng, references, args.max_tokens) for _ in range(args.num_requests)]
        started = time.perf_counter()
        outcomes, peak = await load(client, plans, capacity, pid, args.deadline_s)
        elapsed = time.perf_counter() - started
        facts, failures = await after_run(client, PROMPTS[0], references[PROMPTS[0]], args.max_tokens)
        rss_after = rss_bytes(pid)
    bound = rss_after_warmup * (1 + args.rss_growth)
    if peak > bound:
        failures.append(f"peak RSS {peak / 2**20:.0f} MiB is over {1 + args.rss_growth:.2f}x its "
                        f"{rss_after_warmup / 2**20:.0f} MiB after warm-up")
    failures += [f"{o['kind']}: {f}" for o in outcomes for f in o["failures"]]  # the server's state first, then each request's
    return {
        "requests_sent": len(plans), "seconds": round(elapsed, 1), "requests_per_s": round(len(plans) / elapsed, 1),
        "requests_by_kind": dict(Counter(p["kind"] for p in plans)), "choices_asked": sum(seats(p) for p in plans),
        "responses_by_status": dict(sorted(Counter(str(o["status"]) for o in outcomes).items())), **facts,
        "rss_mib": {"after_warmup": round(rss_after_warmup / 2**20), "peak": round(peak / 2**20),
                    "after": round(rss_after / 2**20), "bound": round(bound / 2**20)},
        "num_failures": len(failures), "failures": failures[:50],
    }


def start_server(args: argparse.Namespace, engine_process: bool, tool: str) -> tuple[ServerProcess, Path]:
    """`cbjax serve` with the command's engine flags; its log goes to --log-dir, named by tool and core mode."""
    log = Path(args.log_dir) / f"{tool}-server-{'process' if engine_process else 'thread'}.log"
    server = ServerProcess(Path(args.model), log, "--served-model-name", tool, "--max-num-seqs", str(args.max_num_seqs),
                           "--max-model-len", str(args.max_model_len),
                           "--engine-process" if engine_process else "--no-engine-process", *args.serve_flags.split())
    return server, log


def report(args: argparse.Namespace, run_mode, **facts) -> None:
    """Run each core mode --engine-process names, print and write the JSON, exit 1 when anything failed."""
    if args.model == "tiny":  # the test suite's tiny model: thousands of requests in minutes on 2 cores
        from tiny_checkpoint import make_tiny_checkpoint  # torch and transformers: only for this
        args.model = str(make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="cbjax-tiny-")), "llama")[1])
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.engine_process]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": " ".join(sys.argv), "commit": commit, "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs",
              "model": args.model, **facts, "runs": [run_mode(args, engine_process) for engine_process in modes]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.result_json:
        Path(args.result_json).write_text(text + "\n")
    sys.exit(1 if any(run["num_failures"] for run in result["runs"]) else 0)


def run_mode(args: argparse.Namespace, engine_process: bool) -> dict:
    server, log = start_server(args, engine_process, "soak")
    try:
        result = asyncio.run(soak(server, args))
    finally:
        exit_code = server.stop()
    if exit_code != 0:
        result["failures"].append(f"the server exited {exit_code} on SIGTERM; log: {log}")
        result["num_failures"] += 1
    return {"engine_process": engine_process, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct", help="a checkpoint, or tiny: the test suite's random tiny model")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the engine's capacity")
    parser.add_argument("--load-factor", type=float, default=2.0, help="sequences kept in flight, in units of --max-num-seqs")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--engine-process", choices=["on", "off", "both"], default="both")
    parser.add_argument("--rss-growth", type=float, default=0.25, help="peak RSS may exceed its value after warm-up by this fraction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline-s", type=float, default=900, help="requests unanswered this long after the load starts fail")
    parser.add_argument("--serve-flags", default="", help='more `cbjax serve` flags, e.g. "--max-waiting-requests 16"')
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--result-json")
    args = parser.parse_args()
    report(args, run_mode, max_num_seqs=args.max_num_seqs, load_factor=args.load_factor, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
