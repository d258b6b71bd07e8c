"""The engine builds each request's outputs as its output_kind asks (vLLM V1's OutputProcessor):
FINAL_ONLY gets one output, when it finishes; DELTA only what is new. Expectations come from
transformers' greedy tokens and the tokenizer's own decode, never from cbjax's output."""

from __future__ import annotations

import queue

import pytest
from engine_helpers import hf_greedy, random_prompts
from tiny_llm import llm, tiny  # noqa: F401 - the shared fixtures

from cbjax import RequestOutputKind, SamplingParams
from cbjax.engine.core_client import ThreadCoreClient

PROMPT = random_prompts(0, [1, 7, 8, 9])[3]  # test_output_semantics' prompt: greedy text 'n\ufffdAnAANTh%A'


@pytest.fixture(scope="module")
def greedy(tiny, llm):
    tokens = hf_greedy(tiny[0], PROMPT, 10)
    return tokens, llm.get_tokenizer().decode(tokens)


def outputs_by_request(llm, requests: dict[str, SamplingParams]) -> dict[str, list]:
    engine = llm.llm_engine
    for request_id, params in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": PROMPT}, params)
    outputs: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def params(kind: RequestOutputKind, **options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=kind, **options)


def test_final_only_gets_one_output_and_delta_each_new_token_once(llm, greedy):
    tokens, text = greedy
    outputs = outputs_by_request(llm, {
        "final": params(RequestOutputKind.FINAL_ONLY, logprobs=1),
        "delta": params(RequestOutputKind.DELTA, logprobs=1),
        "cumulative": params(RequestOutputKind.CUMULATIVE),
    })
    (final,) = outputs["final"]
    assert final.finished and final.outputs[0].token_ids == tokens and final.outputs[0].text == text
    assert len(final.outputs[0].logprobs) == 10 and final.prompt_token_ids == PROMPT
    # One output per sampled token (the prompt's step samples the first): each holds that token only.
    delta = outputs["delta"]
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in tokens]
    assert [len(o.outputs[0].logprobs) for o in delta] == [1] * 10
    assert [list(o.outputs[0].logprobs[0])[0] for o in delta] == tokens  # the sampled token's entry first
    assert "".join(o.outputs[0].text for o in delta) == text
    assert [o.finished for o in delta] == [False] * 9 + [True]
    assert [o.outputs[0].token_ids for o in outputs["cumulative"]] == [tokens[:k] for k in range(1, 11)]


def test_delta_holds_back_text_that_may_begin_a_stop_string(llm, greedy):
    tokens, text = greedy
    stop = "Th%B"  # never completed: 'Th%' is held back until 'A' follows and rules it out
    outputs = outputs_by_request(llm, {"delta": params(RequestOutputKind.DELTA, stop=stop)})["delta"]
    assert "".join(o.outputs[0].text for o in outputs) == text
    sent = [len("".join(o.outputs[0].text for o in outputs[: k + 1])) for k in range(10)]
    decoded = [len(llm.get_tokenizer().decode(tokens[: k + 1])) for k in range(10)]
    # Until the last output, len(stop) - 1 characters stay back (vLLM's streaming rule).
    assert sent[:-1] == [max(0, n - len(stop) + 1) for n in decoded[:-1]] and sent[-1] == len(text)


class StepRecorder:
    """A stat logger that keeps every step's IterationStats."""

    def __init__(self):
        self.iterations = []

    def record_step(self, iteration):
        self.iterations.append(iteration)


def test_final_only_gets_one_output_while_a_stat_logger_counts_every_step(llm, greedy):
    """Issue 35 (9): a stat logger reads the steps' rows, so a FINAL_ONLY request's sink still gets
    one output, at the end, and the logger still sees each of its tokens."""
    tokens, text = greedy
    recorder, received = StepRecorder(), queue.SimpleQueue()
    client = ThreadCoreClient(llm.llm_engine, [recorder])
    client.start()
    try:
        client.add_request("final", {"prompt_token_ids": PROMPT}, params(RequestOutputKind.FINAL_ONLY), received.put)
        final = received.get(timeout=60)
    finally:
        client.shutdown(timeout=60)  # nothing more can come once the core thread is gone
        llm.llm_engine.book.iteration_stats = None  # (the engine is shared with other modules)
    assert final.finished and final.outputs[0].token_ids == tokens and final.outputs[0].text == text
    assert received.empty(), "one output: no output per step for the stat logger"
    iterations = recorder.iterations
    assert [i.num_generation_tokens for i in iterations if i.num_generation_tokens] == [1] * 10
    assert sum(i.num_prompt_tokens for i in iterations) == len(PROMPT)
    assert sum(len(i.time_to_first_tokens) for i in iterations) == 1
    assert sum(count for i in iterations for _, count in i.inter_token_latencies) == 9
    (finished,) = [f for i in iterations for f in i.finished_requests]
    assert (finished.request_id, finished.finish_reason, finished.num_generation_tokens) == ("final", "length", 10)
