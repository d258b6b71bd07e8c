"""Fuzz `cbjax serve` with schemathesis against its own OpenAPI schema (issue 35): every route, valid
and invalid requests, each response checked (no 5xx but the overload gate's 503 with Retry-After,
status code, content type and body as the schema declares); a failure is recorded and fuzzing goes
on. Afterwards the server must answer /health, hold no request or KV block and still give a greedy
prompt its continuation from before. One JSON object per core mode; exits 1 when anything failed.

    python -m benchmarks.fuzz_server --result-json bench_results/fuzz_server.json

tests/entrypoints/test_server_fuzz.py is the suite's short run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from schemathesis.core.failures import FailureGroup

from benchmarks.soak_server import PROMPTS, after_run, greedy_body, report, rss_bytes, start_server


def overload_503_only(ctx, response, case):
    """not_a_server_error, except the overload gate's deliberate 503 (it sends Retry-After)."""
    if response.status_code == 503 and "retry-after" in {name.lower() for name in response.headers}:
        return None
    return not_a_server_error(ctx, response, case)


CHECKS = [overload_503_only, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz_operation(operation, url: str, examples: int, deadline: float, statuses: Counter, failures: list) -> None:
    """`examples` valid and invalid requests to one operation, until `deadline` (time.monotonic)."""

    @given(case=st.one_of([operation.as_strategy(mode) for mode in GenerationMode]))
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        if time.monotonic() > deadline:
            return
        try:
            response = case.call(base_url=url, timeout=60)
        except Exception as error:  # the server did not answer: recorded, and fuzzing goes on
            statuses["no answer"] += 1
            failures.append({"operation": operation.label, "failure": f"{type(error).__name__}: {error}",
                             "request": case.as_curl_command()})
            return
        statuses[str(response.status_code)] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as error:  # every broken check, with the response
            failures.append({"operation": operation.label, "failure": str(error)[:2000],
                             "request": case.as_curl_command()})

    fuzz()


def run_mode(args: argparse.Namespace, engine_process: bool) -> dict:
    server, log = start_server(args, engine_process, "fuzz")
    statuses: Counter = Counter()
    failures: list = []
    try:
        reference = httpx.post(f"{server.url}/v1/completions", json=greedy_body(PROMPTS[0], 8), timeout=60).json()
        rss_before = rss_bytes(server.process.pid)
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        started = time.monotonic()
        for operation in operations:
            fuzz_operation(operation, server.url, args.examples_per_route, started + args.deadline_s, statuses, failures)
        seconds = time.monotonic() - started
        rss_after = rss_bytes(server.process.pid)
        facts, after_failures = asyncio.run(_after_run(server.url, reference["choices"][0]["text"]))
    finally:
        exit_code = server.stop()
    failures += [{"operation": "after the run", "failure": f} for f in after_failures]
    if exit_code != 0:
        failures.append({"operation": "SIGTERM", "failure": f"the server exited {exit_code}; log: {log}"})
    return {"engine_process": engine_process, "routes": [op.label for op in operations],
            "requests_sent": sum(statuses.values()), "seconds": round(seconds, 1),
            "responses_by_status": dict(sorted(statuses.items())), **facts,
            "rss_mib": {"before": round(rss_before / 2**20), "after": round(rss_after / 2**20)},
            "num_failures": len(failures), "failures": failures[:50]}


async def _after_run(url: str, reference: str) -> tuple[dict, list[str]]:
    async with httpx.AsyncClient(base_url=url) as client:
        return await after_run(client, PROMPTS[0], reference, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct", help="a checkpoint, or tiny: the test suite's random tiny model")
    parser.add_argument("--examples-per-route", type=int, default=400)
    parser.add_argument("--deadline-s", type=float, default=900, help="stop generating requests this long after the start")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=96, help="bounds every generation a fuzzed request asks for")
    parser.add_argument("--engine-process", choices=["on", "off", "both"], default="both")
    parser.add_argument("--serve-flags", default="", help='more `cbjax serve` flags, e.g. "--max-waiting-requests 4"')
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--result-json")
    args = parser.parse_args()
    report(args, run_mode, schemathesis=schemathesis.__version__, examples_per_route=args.examples_per_route)


if __name__ == "__main__":
    main()
