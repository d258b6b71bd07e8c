"""LLM.beam_search against a plain beam search written here over transformers' log-probs."""

from __future__ import annotations

import re

import pytest
import torch
from helpers_hf import load_hf_model
from engine_helpers import hf_greedy, random_prompts
from tiny_llm import EOS_TOKEN_IDS, llm, tiny  # noqa: F401 - the shared fixtures

from tokenizers import Tokenizer

from cbjax import BeamSearchParams
from cbjax.core.structured.guidance import GuidanceBackend
from cbjax.sampling_params import StructuredOutputsParams

EOS = EOS_TOKEN_IDS
PROMPTS = random_prompts(0, [9, 5])


def reference_beam_search(hf_dir, prompt: list[int], params: BeamSearchParams,
                          grammar_after=None) -> list[tuple[list[int], float]]:
    """Hugging Face-style beam search as vLLM defines it: (tokens, cumulative logprob), best first.
    grammar_after(output tokens): a constraint's grammar replayed over them (vLLM's way); a constrained
    beam's candidates are those it allows, and a beam whose grammar is complete is finished."""
    model = load_hf_model(hf_dir)
    vocab = model.config.vocab_size

    def score(beam):  # vLLM ranks candidates and final beams alike by this (an EOS is not counted)
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] in EOS)) ** params.length_penalty

    live, finished = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], -1)
            top = torch.topk(logprobs, 2 * params.beam_width)
            allowed = None if grammar_after is None else grammar_after(tokens[len(prompt):]).allowed_token_ids(vocab)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                if allowed is not None and token not in allowed:
                    continue
                grown = (tokens + [token], cum + logprob)
                (finished if token in EOS and not params.ignore_eos else candidates).append(grown)
        live = sorted(candidates, key=score, reverse=True)[: params.beam_width]
        if grammar_after is not None:
            finished += [beam for beam in live if grammar_after(beam[0][len(prompt):]).is_terminated()]
            live = [beam for beam in live if beam not in finished]
    return sorted(finished + live, key=score, reverse=True)[: params.beam_width]


@pytest.mark.parametrize(
    "params",
    [
        BeamSearchParams(beam_width=2, max_tokens=5),
        BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.0),
        BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=2.0, include_stop_str_in_output=True),
        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True),
    ],
)
def test_beam_search_matches_a_reference_over_transformers(tiny, llm, params):
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokenizer = llm.get_tokenizer()
    ended_on_eos = 0
    for prompt, output in zip(PROMPTS, outputs):
        want = reference_beam_search(tiny[0], prompt, params)
        assert [beam.tokens for beam in output.sequences] == [tokens for tokens, _ in want]
        for beam, (tokens, cum) in zip(output.sequences, want):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(beam.logprobs) == len(tokens) - len(prompt)
            eos_end = tokens[-1] in EOS and not params.ignore_eos
            ended_on_eos += eos_end
            assert (beam.finish_reason, beam.stop_reason) == (("stop", tokens[-1]) if eos_end else ("length", None))
            shown = tokens[:-1] if eos_end and not params.include_stop_str_in_output else tokens
            assert beam.text == tokenizer.decode(shown, skip_special_tokens=False)
    if not params.ignore_eos:
        assert ended_on_eos, "no returned beam ended on EOS: the EOS path went untested"


def test_beam_search_rejects_what_it_cannot_run(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=3)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=125))
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_one_beam_without_eos_is_greedy_decoding(tiny, llm):
    """beam_width=1 keeps the single best token each step: transformers' greedy continuation."""
    prompt = "Once upon a time"
    prompt_ids = llm.get_tokenizer().encode(prompt)
    (output,) = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=4, ignore_eos=True))
    (beam,) = output.sequences
    assert beam.tokens == prompt_ids + hf_greedy(tiny[0], prompt_ids, 4)


def test_constrained_beams_take_only_allowed_candidates_and_stop_when_complete(tiny, llm):
    """Each beam's candidates are those its grammar allows (a reference replays the grammar per beam, as vLLM);
    every returned beam matches the constraint, ending on EOS or on its grammar's completion."""
    regex = r"[a-z]{1,6}( [a-z]{1,6})?"
    constraint = StructuredOutputsParams(regex=regex)
    params = BeamSearchParams(beam_width=3, max_tokens=14, structured_outputs=constraint)
    backend = GuidanceBackend(Tokenizer.from_file(str(tiny[0] / "tokenizer.json")), 320, sorted(EOS))

    def grammar_after(tokens):
        grammar = backend.compile(constraint)
        assert grammar.accept_tokens(tokens)
        return grammar

    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(outputs[0].sequences) == params.beam_width  # (the first prompt's beams live: no vacuous pass)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs):
        want = reference_beam_search(tiny[0], prompt, params, grammar_after)
        # The random model's 6 best first tokens may all be disallowed: then every beam ends (vLLM's rule).
        assert [beam.tokens for beam in output.sequences] == [tokens for tokens, _ in want]
        for beam in output.sequences:
            answer = beam.tokens[len(prompt):]
            answer = answer[:-1] if answer[-1] in EOS else answer
            assert beam.finish_reason == "stop" and re.fullmatch(regex, tokenizer.decode(answer)), beam
