"""vLLM's prompt forms everywhere a prompt is taken (issue 35, defect 11): a str, a TextPrompt
({"prompt": text}) and a TokensPrompt ({"prompt_token_ids": ids}, with or without its text), and
keys for inputs cbjax does not take refused by name."""

from __future__ import annotations

import pytest
from engine_helpers import hf_greedy
from tiny_llm import llm, tiny  # noqa: F401 - the shared fixtures

from cbjax import BeamSearchParams, SamplingParams

TEXT = "hello world"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def prompt_forms(token_ids: list[int]) -> list:
    return [TEXT, {"prompt": TEXT}, {"prompt_token_ids": token_ids}, {"prompt": TEXT, "prompt_token_ids": token_ids}]


def test_generate_takes_each_of_vllms_prompt_forms(llm, tiny):  # noqa: F811
    token_ids = llm.get_tokenizer().encode(TEXT)
    outputs = llm.generate(prompt_forms(token_ids), GREEDY, use_tqdm=False)
    assert [output.prompt for output in outputs] == [TEXT, TEXT, None, TEXT]
    expected = hf_greedy(tiny[0], token_ids, 4)
    for output in outputs:
        assert output.prompt_token_ids == token_ids and output.outputs[0].token_ids == expected


def test_engine_add_request_takes_a_text_prompt(llm, tiny):  # noqa: F811
    engine = llm.llm_engine
    token_ids = llm.get_tokenizer().encode(TEXT)
    engine.add_request("text-prompt", {"prompt": TEXT}, GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [output for output in engine.step() if output.finished]
    (output,) = finished
    assert (output.prompt, output.prompt_token_ids) == (TEXT, token_ids)
    assert output.outputs[0].token_ids == hf_greedy(tiny[0], token_ids, 4)


def test_beam_search_takes_a_text_prompt_as_vllm_does(llm):  # noqa: F811
    """vLLM's LLM.beam_search takes exactly {"prompt": text}: the same beams as the prompt's ids."""
    token_ids = llm.get_tokenizer().encode(TEXT)
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    by_form = [llm.beam_search([prompt], params)[0] for prompt in prompt_forms(token_ids)]
    expected = [(beam.tokens, beam.cum_logprob) for beam in by_form[2].sequences]
    assert all(beam.tokens[: len(token_ids)] == token_ids for beam in by_form[2].sequences)
    for output in by_form:
        assert [(beam.tokens, beam.cum_logprob) for beam in output.sequences] == expected


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": TEXT, "multi_modal_data": {"image": None}},
     r"prompt keys \['multi_modal_data'\] are vLLM inputs cbjax does not take \(cbjax serves text-only models\)"),
    ({"prompt_embeds": [[0.0, 1.0]]}, r"prompt keys \['prompt_embeds'\] are vLLM inputs cbjax does not take"),
    ({"prompt_token_ids": [5, 6], "cache_salt": "tenant-a"}, r"prompt keys \['cache_salt'\]"),
    ({"prompt": TEXT, "promt_token_ids": [5]}, r"unknown prompt keys \['promt_token_ids'\]; a prompt dict takes"),
    ({"prompt": 5}, r"'prompt' must be a str, got 5 \(int\)"),
    ({"prompt": None}, r"'prompt' must be a str, got None"),
])
def test_prompt_keys_cbjax_does_not_take_are_refused_by_name(llm, prompt, message):  # noqa: F811
    with pytest.raises(ValueError, match="prompt 0: " + message):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("refused", prompt, GREEDY)
    with pytest.raises(ValueError, match=message):
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3))
    assert not llm.llm_engine.has_unfinished_requests() and "refused" not in llm.llm_engine.book.requests
