"""The engine builds each request's outputs as its output_kind asks (vLLM V1's OutputProcessor):
FINAL_ONLY gets one output, when it finishes; DELTA only what is new. Expectations come from
transformers' greedy tokens and the tokenizer's own decode, never from cbjax's output."""

from __future__ import annotations

import pytest
from engine_helpers import hf_greedy, random_prompts
from tiny_llm import llm, tiny  # noqa: F401 - the shared fixtures

from cbjax import RequestOutputKind, SamplingParams

PROMPT = random_prompts(0, [1, 7, 8, 9])[3]  # test_output_semantics' prompt: greedy text 'n\ufffdAnAANTh%A'


@pytest.fixture(scope="module")
def greedy(tiny, llm):
    tokens = hf_greedy(tiny[0], PROMPT, 10)
    return tokens, llm.get_tokenizer().decode(tokens)


def outputs_by_request(llm, requests: dict[str, SamplingParams], report_every_step: bool = False) -> dict[str, list]:
    engine = llm.llm_engine
    engine.output_processor.report_every_step = report_every_step
    try:
        for request_id, params in requests.items():
            engine.add_request(request_id, {"prompt_token_ids": PROMPT}, params)
        outputs: dict[str, list] = {request_id: [] for request_id in requests}
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id].append(output)
    finally:
        engine.output_processor.report_every_step = False
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


def test_final_only_reports_every_step_when_a_stats_reader_asks(llm, greedy):
    tokens, _ = greedy
    outputs = outputs_by_request(llm, {"final": params(RequestOutputKind.FINAL_ONLY)}, report_every_step=True)["final"]
    assert [o.metrics.num_generation_tokens for o in outputs] == list(range(1, 11))
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == tokens
