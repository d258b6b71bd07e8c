"""`cbjax serve` fuzzed by schemathesis against its own OpenAPI schema (issue 35): every route, a few
dozen generated requests each; no 5xx except the overload gate's 503, every response as the schema
declares it, and afterwards every KV block is free and the server still serves a greedy completion
equal to transformers'."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from engine_helpers import hf_greedy
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from server_process import ServerProcess
from tiny_checkpoint import make_tiny_checkpoint
from tokenizers import Tokenizer

# A short context bounds every generation the fuzzer asks for (max_tokens <= MAX_MODEL_LEN - prompt).
MAX_MODEL_LEN = 48
ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "32",
                "--block-size", "8", "--num-kv-blocks", "64", "--dtype", "float32", "--served-model-name", "tiny",
                "--max-request-bytes", "20000", "--no-engine-process"]
EXAMPLES_PER_ROUTE = 50


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fuzz"), "llama")


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    process = ServerProcess(tiny[1], tmp_path_factory.mktemp("logs") / "server.log", *ENGINE_FLAGS)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def served_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def overload_503_only(ctx, response, case):
    """not_a_server_error, except the overload gate's deliberate 503 (it sends Retry-After); a 503
    from a dead engine has none and fails."""
    if response.status_code == 503 and "retry-after" in {name.lower() for name in response.headers}:
        return None
    return not_a_server_error(ctx, response, case)


def test_every_route_answers_as_its_schema_says(served_schema, server):
    """Valid and invalid bodies for each operation the schema lists; the first broken check fails
    the test with its request (no shrinking: each example is a real request)."""
    operations = [result.ok() for result in served_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    for operation in operations:
        cases = st.one_of([operation.as_strategy(mode) for mode in GenerationMode])

        @given(case=cases)
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            case.call_and_validate(base_url=server.url, timeout=30, checks=[
                overload_503_only, status_code_conformance, content_type_conformance, response_schema_conformance,
            ])

        fuzz()


def idle_gauges(server, timeout: float = 10.0) -> dict[str, float]:
    """vllm:num_requests_running / _waiting and kv_cache_usage_perc, once all are zero (or at the timeout)."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        gauges = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name in names}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)


def test_server_serves_greedy_after_fuzzing(server, tiny):
    prompt = [5, 17, 42, 99, 7]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert idle_gauges(server) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                                   "vllm:kv_cache_usage_perc": 0}
    response = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    want = hf_greedy(tiny[0], prompt, 8)
    # the streamed-text rule holds back a trailing incomplete character (U+FFFD), as in test_server.py
    text = Tokenizer.from_file(str(tiny[0] / "tokenizer.json")).decode(want, skip_special_tokens=True)
    assert choice["text"] == text.rstrip("\ufffd")
