"""Stop handling and logprob sums exactly as vLLM V1 reports them, on a tiny random model.

Every expectation is worked out from transformers' greedy tokens with vLLM's documented rule
(vllm/v1/engine/detokenizer.py, output_processor.py), never from cbjax's own output.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from helpers_hf import load_hf_model
from engine_helpers import ENGINE_OPTIONS, hf_greedy, random_prompts
from tiny_llm import llm, tiny  # noqa: F401 - the shared fixtures

from cbjax import EngineConfig, SamplingParams
from cbjax.engine.llm_engine import LLMEngine

# Prompt 3 of test_engine's set; transformers continues it greedily with the texts
# 'n', '\ufffd', 'A', 'n', 'A', 'A', 'N', 'Th', '%', 'A' (asserted in `greedy` below).
PROMPT = random_prompts(0, [1, 7, 8, 9])[3]


@pytest.fixture(scope="module")
def greedy(tiny, llm):
    tokens = hf_greedy(tiny[0], PROMPT, 10)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode(tokens[:k]) for k in range(len(tokens) + 1)]
    assert texts[-1] == "n\ufffdAnAANTh%A", "the tiny model's greedy answer changed: re-pick the stops below"
    return tokens, texts


def run(llm, **params):
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, **params), use_tqdm=False)
    return out.outputs[0]


@pytest.mark.parametrize("min_tokens", [0, 2, 3, 5])
def test_stop_strings_wait_for_min_tokens(llm, greedy, min_tokens):
    """vLLM matches a stop string only in text of tokens past the first min_tokens."""
    tokens, texts = greedy
    out = run(llm, max_tokens=10, min_tokens=min_tokens, stop="A")
    # "A" is one character, so a match lies wholly in text decoded after token min_tokens.
    cut = texts[-1].find("A", len(texts[min_tokens]))
    assert (out.finish_reason, out.stop_reason) == ("stop", "A")
    assert out.text == texts[-1][:cut]
    num_tokens = next(k for k in range(1, 11) if len(texts[k]) > cut)  # the token that completed the match
    assert out.token_ids == tokens[:num_tokens]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked_for(llm, greedy, include):
    """Ending on a stop token id (or EOS) keeps the id in token_ids but not its text in `text`."""
    tokens, texts = greedy
    stop_id = tokens[6]  # 'N', not among the first six tokens
    assert stop_id not in tokens[:6]
    out = run(llm, max_tokens=10, stop_token_ids=[stop_id], include_stop_str_in_output=include)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == tokens[:7]
    assert out.text == (texts[7] if include else texts[6])
    assert texts[7] != texts[6]


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_left_out_unless_asked_for(tiny, llm, include):
    """The shared checkpoint's second EOS, 229, is an ordinary byte token, so its text is visible."""
    prompt = random_prompts(0, [1, 7, 8, 9, 17, 40])[5]
    tokens = hf_greedy(tiny[0], prompt, 10)
    assert tokens.index(229) == 9 and 2 not in tokens
    params = SamplingParams(temperature=0.0, max_tokens=11, include_stop_str_in_output=include)  # 10 would be "length"
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    assert out.outputs[0].token_ids == tokens
    decode = llm.get_tokenizer().decode
    # Without 229, the byte before it never completes a character: like vLLM, nothing of it shows.
    assert out.outputs[0].text == (decode(tokens) if include else decode(tokens[:9]).rstrip("\ufffd"))
    assert decode(tokens) != decode(tokens[:9]).rstrip("\ufffd")


def test_stop_string_on_the_last_allowed_token_reports_stop(llm, greedy):
    """A stop string completed by the max_tokens-th token is a "stop", not a "length" finish."""
    tokens, texts = greedy
    assert texts[7].find("AN") == 5 and texts[6].find("AN") == -1  # straddles tokens 6 and 7
    out = run(llm, max_tokens=7, stop=["zz", "AN"])
    assert (out.finish_reason, out.stop_reason) == ("stop", "AN")
    assert out.text == texts[7][:5]
    assert out.token_ids == tokens[:7]
    kept = run(llm, max_tokens=7, stop="AN", include_stop_str_in_output=True)
    assert (kept.finish_reason, kept.text) == ("stop", texts[7])


def test_cumulative_logprob_is_the_sum_of_the_sampled_logprobs(tiny, llm, greedy):
    tokens, _ = greedy
    for logprobs in (0, 3):
        out = run(llm, max_tokens=6, logprobs=logprobs, ignore_eos=True)
        sampled = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
        assert out.cumulative_logprob == pytest.approx(sum(sampled), abs=1e-5)
        with torch.no_grad():
            logits = load_hf_model(tiny[0])(torch.tensor([PROMPT + tokens[:5]])).logits[0, len(PROMPT) - 1 :]
        reference = torch.log_softmax(logits, -1).numpy()[np.arange(6), tokens[:6]].sum()
        assert out.cumulative_logprob == pytest.approx(float(reference), abs=1e-4)
    assert run(llm, max_tokens=3).cumulative_logprob is None  # vLLM: None unless logprobs are asked for


def test_engine_without_precompile_compiles_steps_on_demand(tiny, greedy, caplog):
    tokens, _ = greedy
    engine = LLMEngine(EngineConfig(model=str(tiny[1]), **ENGINE_OPTIONS), precompile=False, progress=False)
    assert not engine.runner.compiled
    with caplog.at_level(logging.WARNING, logger="cbjax.worker.model_runner"):
        engine.add_request("a", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=10))
        engine.add_request("b", {"prompt_token_ids": PROMPT[:4]}, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["a"].outputs[0].token_ids == tokens
    assert len(finished["b"].outputs[0].token_ids) == 3
    compiled = set(engine.runner.compiled)
    assert compiled and len(compiled) < len(engine.runner.buckets)  # only the buckets these steps needed
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "precompile" in warnings[0].getMessage()


def test_unfinished_outputs_hold_back_a_possible_stop_string(llm, greedy):
    """vLLM's intermediate outputs leave out the last len(longest stop) - 1 characters until finished."""
    tokens, texts = greedy
    engine = llm.llm_engine
    engine.add_request("held", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=10, stop=["AN", "zzz"]))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "held"]
    *streaming, final = seen
    for out in streaming:
        so_far = texts[len(out.outputs[0].token_ids)].rstrip("\ufffd")  # an unfinished character waits too
        assert out.outputs[0].text == so_far[: max(0, len(so_far) - 2)]
    assert final.outputs[0].text == texts[7][:5] and final.outputs[0].stop_reason == "AN"
