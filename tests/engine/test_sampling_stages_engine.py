"""logit_bias, allowed_token_ids and bad_words end to end on the tiny model: greedy with a bias
equals transformers' greedy on the biased logits, allowed ids bound every token, a bad word that
the plain request produces never appears, and a mixed workload (a constrained request too) compiles
nothing while serving."""

from __future__ import annotations

import re

import pytest
import torch
from engine_helpers import COMPILES, ENGINE_OPTIONS, hf_greedy, random_prompts
from helpers_hf import load_hf_model
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.sampling_params import StructuredOutputsParams

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("stages"), "llama")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[1]), **ENGINE_OPTIONS)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, **kwargs)


def generate(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def hf_greedy_masked(hf_dir, prompt: list[int], bias: dict[int, float], allowed: list[int] | None = None) -> list[int]:
    """transformers' greedy where each step's logits get `bias` added (and, with `allowed`, only those ids)."""
    model, ids = load_hf_model(hf_dir), list(prompt)
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if allowed is not None:
                keep = torch.zeros_like(logits, dtype=torch.bool)
                keep[allowed] = True
                logits = logits.masked_fill(~keep, float("-inf"))
            for token_id, value in bias.items():
                logits[token_id] += value
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_greedy_with_logit_bias_equals_transformers_on_biased_logits(llm, tiny):
    prompts = random_prompts(11, [5, 19])
    plain = hf_greedy(tiny[0], prompts[0], NUM_TOKENS)
    # Push the plain continuation's first two tokens down and two others up.
    bias = {plain[0]: -100.0, plain[1]: -30.0, 17: 4.5, 101: 6.0}
    want = hf_greedy_masked(tiny[0], prompts[0], bias)
    assert want != plain
    # Beside a request without a bias, which must be unaffected.
    got = generate(llm, prompts, [greedy(logit_bias=bias), greedy()])
    assert got == [want, hf_greedy(tiny[0], prompts[1], NUM_TOKENS)]


def test_allowed_token_ids_bound_every_token(llm, tiny):
    prompt = random_prompts(12, [9])[0]
    allowed = [5, 40, 77, 150, 222, 300]
    assert generate(llm, [prompt], [greedy(allowed_token_ids=allowed)]) == [hf_greedy_masked(tiny[0], prompt, {}, allowed)]
    sampled = generate(llm, [prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True,
                                                          allowed_token_ids=allowed) for s in range(3)])
    assert all(set(tokens) <= set(allowed) for tokens in sampled)


def occurs(sequence: list[int], tokens: list[int]) -> bool:
    return any(tokens[i : i + len(sequence)] == sequence for i in range(len(tokens) - len(sequence) + 1))


def test_a_bad_word_the_plain_request_produces_never_appears(llm):
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(13, [6, 11, 3, 17])
    plain = generate(llm, prompts, greedy())
    # Two output tokens in a row whose text tokenizes back to them: a two-token bad word.
    found = [(k, tokens[i : i + 2]) for k, tokens in enumerate(plain) for i in range(1, len(tokens) - 1)
             if tokenizer.encode_chat(tokenizer.decode(tokens[i : i + 2]).lstrip()) == tokens[i : i + 2]]
    assert found, "no output pair round-trips through the tokenizer; change the prompts' seed"
    k, pair = found[0]
    word = tokenizer.decode(pair)
    # Also one token the plain output has, as a one-token bad word.
    single = next(t for t in plain[k] if len(tokenizer.encode_chat(tokenizer.decode([t]).lstrip())) == 1
                  and t not in pair and tokenizer.decode([t]).strip())
    (banned,) = generate(llm, [prompts[k]], greedy(bad_words=[word, tokenizer.decode([single]).strip()]))
    assert occurs(pair, plain[k]) and not occurs(pair, banned)
    banned_ids = set(tokenizer.encode_chat(tokenizer.decode([single]).strip()) + tokenizer.encode_chat(" " + tokenizer.decode([single]).strip()))
    assert not banned_ids & set(banned)
    # Up to the first place the plain output would complete a bad word, both are the same.
    first = min([i for i in range(len(plain[k])) if plain[k][i] in banned_ids]
                + [i + 1 for i in range(len(plain[k]) - 1) if plain[k][i : i + 2] == pair])
    assert banned[:first] == plain[k][:first] and banned[first] != plain[k][first]


def test_mixed_workload_with_the_new_fields_compiles_nothing_while_serving(llm):
    prompts = random_prompts(14, [4, 30, 9, 50, 2, 21, 6])
    params = [
        greedy(logit_bias={7: 3.0, 8: -2.0}),
        SamplingParams(temperature=0.9, top_k=20, seed=1, max_tokens=9, allowed_token_ids=[3, 4, 5, 6]),
        greedy(bad_words=["the", "ab"]),
        SamplingParams(temperature=0.7, presence_penalty=0.4, max_tokens=7, logit_bias={9: 1.0}, bad_words=["fox"]),
        greedy(min_tokens=3, allowed_token_ids=[2, 10, 11], logprobs=2),
        greedy(),
        SamplingParams(temperature=0.8, seed=2, max_tokens=9, structured_outputs=StructuredOutputsParams(regex="[a-c]{2,5}")),
    ]
    COMPILES.armed = True
    try:
        outs = generate(llm, prompts, params)
    finally:
        COMPILES.armed = False
    assert COMPILES.count == 0
    assert set(outs[1]) <= {3, 4, 5, 6} and set(outs[4]) <= {2, 10, 11}
    assert re.fullmatch("[a-c]{2,5}", llm.get_tokenizer().decode(outs[6]))


def test_out_of_vocabulary_ids_are_refused_when_the_request_is_added(llm):
    with pytest.raises(ValueError, match=r"token id\(s\) \[320\] in logit_bias are outside the vocabulary \[0, 320\)"):
        llm.generate([{"prompt_token_ids": [5, 6]}], greedy(logit_bias={320: 1.0}), use_tqdm=False)
