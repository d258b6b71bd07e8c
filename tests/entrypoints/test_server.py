"""`cbjax serve` end to end through the official `openai` client (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from helpers_hf import hf_logits
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess
from engine_helpers import hf_greedy
from tiny_checkpoint import make_tiny_checkpoint
from tokenizers import Tokenizer


API_KEY = "test-key"
MAX_MODEL_LEN = 128
ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "32",
                "--block-size", "8", "--num-kv-blocks", "80", "--dtype", "float32"]
PROMPTS = [[5, 17, 42, 99, 7, 3, 250], [12, 13, 14], [200, 201, 8, 9, 10, 11, 77, 78, 79], [30]]
GREEDY = {"temperature": 0.0, "max_tokens": 10}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("server"), "llama")


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax-cache"))  # the second server reuses the first one's compiled steps


@pytest.fixture(scope="module")
def server(tiny, jax_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    process = ServerProcess(tiny[1], log, *ENGINE_FLAGS, "--compilation-cache-dir", jax_cache,
                            "--served-model-name", "tiny", "--max-request-bytes", "20000",
                            env={"CBJAX_API_KEY": API_KEY})
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def decode(tiny):
    """Text of token ids by the tokenizers library; streamed text holds back a trailing incomplete
    character (U+FFFD here), as vLLM's detokenizer does, so that is dropped."""
    tokenizer = Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def metrics(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics (parsed by prometheus_client), keyed by name and sorted labels."""
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)


def wait_until_idle(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = metrics(server)
        idle = (metric(samples, "vllm:num_requests_running") == 0 and metric(samples, "vllm:num_requests_waiting") == 0
                and metric(samples, "vllm:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_greedy_completion_equals_transformers_with_usage(client, tiny, decode):
    for prompt in PROMPTS[:2]:
        response = client.completions.create(model="tiny", prompt=prompt, **GREEDY, extra_body=NO_EOS)
        want = hf_greedy(tiny[0], prompt, GREEDY["max_tokens"])
        (choice,) = response.choices
        assert choice.text == decode(want)
        assert choice.finish_reason == "length"
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), 10)
        assert response.usage.total_tokens == len(prompt) + 10
    echoed = client.completions.create(model="tiny", prompt="Once upon a time", echo=True, **GREEDY, extra_body=NO_EOS)
    plain = client.completions.create(model="tiny", prompt="Once upon a time", **GREEDY, extra_body=NO_EOS)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text


def test_logit_bias_through_the_openai_client(client, decode):
    """OpenAI's logit_bias (token ids as strings): +100 on one token makes greedy repeat it; an id
    outside the vocabulary is a 400 that names it."""
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY, logit_bias={"17": 100})
    assert response.choices[0].text == decode([17] * GREEDY["max_tokens"])
    with pytest.raises(openai.BadRequestError, match=r"\[4000\] in logit_bias are outside the vocabulary"):
        client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY, logit_bias={"4000": 1})


OBJECT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "level"],
                 "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}}}


def test_output_constraints_through_the_openai_client(client):
    """response_format (json_schema) on chat, vLLM's guided_regex and structured_outputs on completions
    and a streamed chat: each output matches its constraint."""
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "level", "schema": OBJECT_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), OBJECT_SCHEMA)
    assert chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0.0,
                                           extra_body={"guided_regex": "[0-9]{2}-[a-c]{2}"})
    assert re.fullmatch("[0-9]{2}-[a-c]{2}", completion.choices[0].text)
    completion = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0.0,
                                           extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert completion.choices[0].text in ("yes", "no")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                            temperature=1.0, seed=2, stream=True,
                                            extra_body={"guided_choice": ["alpha", "beta"]})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("alpha", "beta")


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"$ref": "#/$defs/unit"}},
           "$defs": {"unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": OBJECT_SCHEMA}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": OBJECT_SCHEMA}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_parse_and_validate(client, tool_choice, stream):
    """tool_choice "required" and a named function are forced by a grammar built from the tools'
    schemas ($ref included): the calls the openai client assembles validate against them."""
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                              tools=TOOLS, tool_choice=tool_choice, max_tokens=100, temperature=1.0,
                                              seed=6, stream=stream)  # (random weights: seed 6 closes the array in time)
    if stream:
        calls, finish = {}, None
        for chunk in response:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
        calls = list(calls.values())
    else:
        message, finish = response.choices[0].message, response.choices[0].finish_reason
        assert message.content is None
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert finish == "tool_calls" and calls
    if isinstance(tool_choice, dict):
        assert [call["name"] for call in calls] == ["get_time"]
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "json constraint does not compile"),
    ({"guided_regex": "(a"}, "guided_regex", "regex constraint does not compile"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_json", "guided_json, guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one constraint"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error


def test_streamed_completion_joins_to_the_non_streamed_text(client):
    prompts = ["Once upon a time", "The quick brown fox"]
    plain = client.completions.create(model="tiny", prompt=prompts, **GREEDY, extra_body=NO_EOS)
    stream = client.completions.create(model="tiny", prompt=prompts, **GREEDY, extra_body=NO_EOS, stream=True,
                                       stream_options={"include_usage": True})
    texts, finish, usage = ["", ""], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [c.text for c in sorted(plain.choices, key=lambda c: c.index)]
    assert finish == ["length", "length"]
    assert usage.completion_tokens == 20 and usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_streams_role_then_deltas_then_finish_then_usage(server, tiny, decode):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Paris is"},
                {"role": "assistant", "content": "the capital"}, {"role": "user", "content": "of?"}]
    rendered = "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in messages) + "<s>assistant\n"
    prompt_ids = Tokenizer.from_file(str(tiny[0] / "tokenizer.json")).encode(rendered).ids
    want = decode(hf_greedy(tiny[0], prompt_ids, 10))

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        plain = await client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                                     temperature=0.0, extra_body=NO_EOS)
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0.0, extra_body=NO_EOS, stream=True,
            stream_options={"include_usage": True})]
        return plain, chunks

    plain, chunks = asyncio.run(run())
    assert plain.choices[0].message.content == want and plain.choices[0].message.role == "assistant"
    assert plain.usage.prompt_tokens == len(prompt_ids) and plain.usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == want
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def hf_log_softmax(hf_dir, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy tokens after `prompt` and the log-softmax [num_tokens, vocab] they were picked from."""
    tokens = hf_greedy(hf_dir, prompt, num_tokens)
    logits = torch.tensor(hf_logits(hf_dir, prompt + tokens))
    return tokens, torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]


def test_logprobs_are_transformers_log_softmax(client, tiny):
    prompt = PROMPTS[0]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0.0, logprobs=2,
                                         extra_body=NO_EOS)
    tokens, log_softmax = hf_log_softmax(tiny[0], prompt, 5)
    logprobs = response.choices[0].logprobs
    np.testing.assert_allclose(logprobs.token_logprobs, log_softmax.gather(1, torch.tensor(tokens)[:, None])[:, 0],
                               atol=2e-3)
    top2 = log_softmax.topk(2, dim=-1).values.numpy()
    # Keyed by token text (as OpenAI's is): byte tokens that decode alike share a key, so check membership.
    for top, want in zip(logprobs.top_logprobs, top2):
        assert all(np.isclose(value, want, atol=2e-3).any() for value in top.values())

    chat_ids = Tokenizer.from_file(str(tiny[0] / "tokenizer.json")).encode("<s>user\nhi</s>\n<s>assistant\n").ids
    tokens, log_softmax = hf_log_softmax(tiny[0], chat_ids, 3)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0.0, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    np.testing.assert_allclose([[t.logprob for t in entry.top_logprobs] for entry in content],
                               log_softmax.topk(2, dim=-1).values.numpy(), atol=2e-3)
    np.testing.assert_allclose([entry.logprob for entry in content], log_softmax.max(dim=-1).values.numpy(), atol=2e-3)


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.0,
                                     extra_body=NO_EOS).choices[0].text
    stop = next(full[i : i + 2] for i in range(2, len(full) - 1) if full[i : i + 2].isprintable())
    choice = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.0,
                                       stop=[stop], extra_body=NO_EOS).choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0.0,
                                            stop=[stop], extra_body=NO_EOS, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text, "no streamed piece of the stop string"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_2_gives_two_choices(client):
    response = client.completions.create(model="tiny", prompt="Once", max_tokens=4, n=2, seed=1, extra_body=NO_EOS)
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 8
    assert response.choices[0].text != response.choices[1].text, "seeded completions sample with seed + index"
    greedy = client.completions.create(model="tiny", prompt="Once", max_tokens=4, n=2, temperature=0.0, extra_body=NO_EOS)
    single = client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0.0, extra_body=NO_EOS)
    assert [c.text for c in greedy.choices] == [single.choices[0].text] * 2


def test_32_concurrent_streaming_clients_all_get_their_greedy_text(server, client):
    expected = [client.completions.create(model="tiny", prompt=p, **GREEDY, extra_body=NO_EOS).choices[0].text
                for p in PROMPTS]

    async def one(async_client, prompt):
        stream = await async_client.completions.create(model="tiny", prompt=prompt, **GREEDY, extra_body=NO_EOS,
                                                       stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run():
        async_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*[one(async_client, PROMPTS[i % 4]) for i in range(32)])

    assert asyncio.run(run()) == [expected[i % 4] for i in range(32)]
    wait_until_idle(server)


def test_a_client_that_disconnects_has_its_requests_aborted_and_blocks_freed(server):
    # 32 prompts in one request keep the server busy for many steps (one step takes about a millisecond).
    body = {"model": "tiny", "prompt": [PROMPTS[0]] * 32, "max_tokens": 110, "temperature": 0.0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def aborted() -> float:
        return metric(wait_until_idle(server), "vllm:request_success_total", finished_reason="abort")

    before = aborted()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, headers=headers) as stream:
        next(stream.iter_lines())  # one chunk, then hang up
    after_stream = aborted()
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(5, read=0.05))
    after_plain = aborted()
    assert after_stream - before >= 24 and after_plain - after_stream >= 24, "at most the first seats finished"
    samples = wait_until_idle(server)
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0 and metric(samples, "vllm:num_requests_running") == 0


def test_api_key_is_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    response = httpx.get(f"{server.url}/v1/models")
    assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_models_tokenize_detokenize_version(server, client, tiny):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = Tokenizer.from_file(str(tiny[0] / "tokenizer.json")).encode("Paris is the capital").ids
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": "Paris is the capital"}, headers=headers).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids) and tokenized["max_model_len"] == 128
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=headers).json()["prompt"]
    assert text == "Paris is the capital"
    assert httpx.get(f"{server.url}/version").json()["version"]


BAD_REQUESTS = [
    # (path, body, status, words the message must hold)
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, ["temperature", "-1"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens", "0"]),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 50}, 400, ["maximum context length is 128", "150"]),
    ("/v1/completions", {"prompt": [5] * 128}, 400, ["maximum context length is 128", "128 input tokens"]),
    ("/v1/completions", {"prompt": [1, 10_000]}, 400, ["10000", "vocabulary"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, ["max_tokens", "many"]),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, ["logprobs", "21"]),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, ["gpt-9", "tiny"]),
    ("/v1/completions", {"prompt": "x" * 30_000}, 413, ["20000"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     ["top_logprobs", "logprobs"]),
    ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
    ("/v1/completions", b"{not json", 400, ["JSON"]),
    # vLLM's extra "priority" field reaches the engine core, whose fcfs policy takes none.
    ("/v1/completions", {"prompt": "hi", "priority": 3}, 400, ["priority=3", "scheduling_policy='priority'"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": -1}, 400,
     ["priority=-1", "--scheduling-policy priority"]),
    # Checked before a stream opens: the status is still a 400.
    ("/v1/completions", {"prompt": "hi", "priority": 3, "stream": True}, 400, ["priority=3"]),
    # The server's own bounds (tests/entrypoints/test_server_limits.py has the rest).
    ("/v1/completions", {"prompt": "hi", "n": 1_000_000}, 400, ["n=1000000", "--max-completions-per-request"]),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 17}, 400, ["17", "--max-stop-strings"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "(a"},
     400, ["guided_regex", "regex constraint does not compile"]),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, ["stream=True"]),
]


def test_bad_inputs_get_error_bodies_while_a_neighbour_streams(server, client):
    want = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=60, temperature=0.0,
                                     extra_body=NO_EOS).choices[0].text
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as http:
            async def neighbour():
                body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 60, "temperature": 0.0,
                        "ignore_eos": True, "stream": True}
                text = ""
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            streaming = asyncio.create_task(neighbour())
            await asyncio.sleep(0.05)
            answers = []
            for path, body, _, _ in BAD_REQUESTS:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                answers.append(await http.post(path, content=content))

            async def chunked_body():  # no Content-Length: the limit applies while it streams in
                for _ in range(3):
                    yield b" " * 10_000

            answers.append(await http.post("/v1/completions", content=chunked_body()))
            return await streaming, answers

    text, answers = asyncio.run(run())
    cases = BAD_REQUESTS + [("/v1/completions", "chunked", 413, ["more than 20000 bytes"])]
    for (path, body, status, words), answer in zip(cases, answers, strict=True):
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (status, status), (body, answer.text)
        assert error["type"] and all(word in error["message"] for word in words), (body, error)
    assert text == want, "the neighbour's stream is untouched"


def test_metrics_counters_equal_what_was_sent(server, client):
    before = wait_until_idle(server)
    for prompt, max_tokens in zip(PROMPTS[:3], (3, 5, 7)):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                  extra_body=NO_EOS)
    after = wait_until_idle(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(map(len, PROMPTS[:3]))
    assert delta("vllm:generation_tokens_total") == 3 + 5 + 7
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    # Waiting then the prompt's step: both end before the first token goes out, so they fit in TTFT.
    assert delta("vllm:request_queue_time_seconds_count") == delta("vllm:request_prefill_time_seconds_count") == 3
    assert 0 < (delta("vllm:request_queue_time_seconds_sum") + delta("vllm:request_prefill_time_seconds_sum")
                <= delta("vllm:time_to_first_token_seconds_sum"))
    assert delta("vllm:inter_token_latency_seconds_count") == 2 + 4 + 6
    assert delta("vllm:request_generation_tokens_sum") == 15
    assert delta("vllm:request_prompt_tokens_sum") == sum(map(len, PROMPTS[:3]))
    # Prefix caching: every prompt token is looked up; a hit (only the 9-token prompt has a full
    # 8-token block, cached if an earlier test sent it) is not computed again.
    hits = delta("vllm:prefix_cache_hits_total")
    assert delta("vllm:prefix_cache_queries_total") == sum(map(len, PROMPTS[:3])) and hits in (0, 8)
    assert delta("vllm:iteration_tokens_total_sum") == sum(map(len, PROMPTS[:3])) - hits + 2 + 4 + 6
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:kv_cache_usage_perc") == 0


@pytest.fixture(scope="module")
def small_server(tiny, jax_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "small.log"
    process = ServerProcess(tiny[1], log, *ENGINE_FLAGS, "--compilation-cache-dir", jax_cache,
                            "--served-model-name", "tiny", "--max-waiting-requests", "1", "--shutdown-timeout", "60",
                            "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield process
    process.stop()


def test_a_reasoning_parser_puts_an_unclosed_reply_in_reasoning_content(small_server, tiny, decode):
    """deepseek_r1: a reply that never writes </think> (cut by max_tokens while thinking) is all
    reasoning, whole and streamed, also with tools offered ("auto": the tiny model calls none); the
    splitting itself: tests/entrypoints/test_reasoning.py and test_tool_parsers.py."""
    messages = [{"role": "user", "content": "Think about Paris."}]
    prompt_ids = Tokenizer.from_file(str(tiny[0] / "tokenizer.json")).encode("<s>user\nThink about Paris.</s>\n<s>assistant\n").ids
    want = decode(hf_greedy(tiny[0], prompt_ids, 10))
    assert "</think>" not in want
    client = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0,
                                           extra_body=NO_EOS, tools=tools).choices[0]
    assert (whole.message.model_extra["reasoning_content"], whole.message.content) == (want, None)
    assert not whole.message.tool_calls and whole.finish_reason == "length"
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0.0, extra_body=NO_EOS, stream=True)]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == want
    assert not any(d.content for d in deltas)


async def finish_reasons(http: httpx.AsyncClient, body: dict, first_chunk: asyncio.Event) -> list[str]:
    """Stream a completion request; the finish_reason of every choice, by index."""
    reasons = {}
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                first_chunk.set()
                for choice in json.loads(line[6:])["choices"]:
                    reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    return [reasons[index] for index in sorted(reasons)]


# 32 prompts in one request keep 28 waiting for many steps (one step takes about a millisecond).
BUSY = {"model": "tiny", "prompt": [PROMPTS[0]] * 32, "max_tokens": 110, "temperature": 0.0, "ignore_eos": True}


def test_overload_answers_503_with_retry_after(small_server):
    async def run():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as http:
            busy = asyncio.create_task(finish_reasons(http, BUSY, asyncio.Event()))
            deadline = time.monotonic() + 10
            while metric(metrics(small_server), "vllm:num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            refused = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
            return refused, await busy

    refused, reasons = asyncio.run(run())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    assert int(refused.headers["Retry-After"]) >= 1 and "max-waiting-requests" in refused.json()["error"]["message"]
    assert reasons == ["length"] * 32, "the requests already queued are served"


def test_sigterm_drains_in_flight_streams_then_exits_0(small_server):
    async def run():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as http:
            started = asyncio.Event()
            busy = asyncio.create_task(finish_reasons(http, BUSY, started))
            await asyncio.wait_for(started.wait(), 30)
            small_server.terminate()
            return await busy

    assert asyncio.run(run()) == ["length"] * 32, "every in-flight request finishes"
    assert small_server.process.wait(30) == 0


def test_binding_beyond_loopback_without_a_key_warns(caplog, monkeypatch):
    from cbjax.entrypoints.cli.main import build_parser

    monkeypatch.delenv("CBJAX_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "./no/such/model", "--host", "0.0.0.0"])
    with pytest.raises(ValueError, match="does not exist"):  # the warning comes before the model is loaded
        args.func(args)
    assert "without --api-key" in caplog.text
    caplog.clear()
    with pytest.raises(ValueError):
        args.func(build_parser().parse_args(["serve", "./no/such/model", "--host", "127.0.0.1"]))
    assert "without --api-key" not in caplog.text


@pytest.fixture(scope="module")
def priority_server(tiny, jax_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "priority.log"
    # Room for BUSY's prompts 3x longer (the later flags win): see the test.
    process = ServerProcess(tiny[1], log, *ENGINE_FLAGS, "--compilation-cache-dir", jax_cache,
                            "--served-model-name", "tiny", "--scheduling-policy", "priority",
                            "--max-model-len", "384", "--num-kv-blocks", "200")
    yield process
    assert process.stop() == 0


def test_priority_policy_serves_an_urgent_request_before_those_queued_earlier(priority_server):
    # BUSY's 32 prompts (priority 0) hold the 4 seats and keep 28 waiting; once 20 or more still wait, "low"
    # (priority 5) and "urgent" (priority -1) queue. The urgent one takes the first free seat: at most the 4
    # prompts running when it came finish before it (under fcfs, all 32 would). "low" goes last.
    async def run():
        async with httpx.AsyncClient(base_url=priority_server.url, timeout=120) as http:
            order = []
            # BUSY's prompts 3x longer here, so a wave of 4 lasts long enough for the two requests to cross
            # HTTP on a slow machine (a fresh-clone run once saw them reach the engine 6 waves of 110 tokens late)
            busy_body = BUSY | {"max_tokens": 330, "stream": True}

            async def short(name: str, priority: int) -> None:
                body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0.0,
                        "ignore_eos": True, "priority": priority}
                answer = await http.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
                order.append(name)

            async def busy() -> None:
                async with http.stream("POST", "/v1/completions", json=busy_body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            order.extend("busy" for choice in json.loads(line[6:])["choices"] if choice["finish_reason"])

            tasks = [asyncio.create_task(busy())]
            deadline = time.monotonic() + 30
            # 20 or more waiting: 5 or more waves still to run. (Waiting for all 28 missed the first wave's
            # window once in a loaded full-suite run, polling /metrics for 30 s.)
            while metric(metrics(priority_server), "vllm:num_requests_waiting") < 20:
                if tasks[0].done():
                    tasks[0].result()  # BUSY's request failed: its error, not a timeout
                assert time.monotonic() < deadline, "BUSY's prompts never waited"
                await asyncio.sleep(0.005)
            finished_before = order.count("busy")
            tasks += [asyncio.create_task(short("low", 5)), asyncio.create_task(short("urgent", -1))]
            await asyncio.gather(*tasks)
            return order, finished_before

    order, finished_before = asyncio.run(run())
    assert order.count("busy") == 32
    # Until the two requests reach the engine a few more BUSY prompts may finish (a loaded machine
    # steps on while they cross HTTP): allow 4 more than the 4 seats; fcfs would put "urgent" 32nd.
    assert order.index("urgent") <= finished_before + 8 < 32 < order.index("low"), order
