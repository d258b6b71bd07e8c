"""Structured outputs end to end on the tiny random-weight model (random logits stress the mask): every
output validates under its constraint (jsonschema, a regex, a choice, a Lark grammar), greedy and
sampled; the mask equals llguidance's allowed set at every step; unconstrained requests in the same
batch get exactly their tokens alone; n > 1; max_tokens still cuts; a bad constraint fails alone."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import numpy as np
import pytest
from tiny_llm import EOS_TOKEN_IDS, llm, tiny  # noqa: F401
from tokenizers import Tokenizer

from cbjax import SamplingParams
from cbjax.core.structured.backend import bitmask_words
from cbjax.core.structured.guidance import GuidanceBackend
from cbjax.core.structured.manager import StructuredOutputManager
from cbjax.sampling_params import GuidedDecodingParams, StructuredOutputsParams

VOCAB = 320  # the tiny model's logits width
SCHEMAS = [
    {  # nested objects, an optional field
        "type": "object", "additionalProperties": False, "required": ["user"],
        "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "role"],
                                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                               "role": {"enum": ["admin", "guest"]},
                                               "nick": {"type": "string", "maxLength": 4}}}},
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["ok", "level"],
     "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}}},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "string", "pattern": "^[a-c]{1,3}$"}]},
    {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                         "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                        "y": {"type": "integer", "minimum": -5, "maximum": 5}}}},
     "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
]
REGEXES = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"]
CHOICES = ["red", "green", "blue"]
LARK = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[a-c]{1,2}/'
LARK_LANGUAGE = r"\([a-c]{1,2}(,[a-c]{1,2}){0,2}\)"
PROMPT = {"prompt_token_ids": [5, 17, 42, 8]}


def constraints() -> list[tuple[StructuredOutputsParams, object]]:
    """(constraint, a check of an output text against it, independent of llguidance)."""
    cases = [(StructuredOutputsParams(json=schema), lambda text, s=schema: jsonschema.validate(json.loads(text), s))
             for schema in SCHEMAS]
    cases += [(StructuredOutputsParams(regex=regex), lambda text, r=regex: _assert_full_match(r, text))
              for regex in REGEXES]
    cases.append((StructuredOutputsParams(choice=CHOICES), lambda text: _assert(text in CHOICES, text)))
    cases.append((StructuredOutputsParams(grammar=LARK), lambda text: _assert_full_match(LARK_LANGUAGE, text)))
    return cases


def _assert(condition: bool, text: str) -> None:
    assert condition, text


def _assert_full_match(regex: str, text: str) -> None:
    assert re.fullmatch(regex, text), (regex, text)


def generate(llm, params: list[SamplingParams]):  # noqa: F811
    return llm.generate([PROMPT] * len(params), params, use_tqdm=False)


def test_outputs_satisfy_their_constraints_and_leave_unconstrained_requests_as_alone(llm):  # noqa: F811
    plain = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)]
    alone = generate(llm, plain)
    cases = constraints()
    constrained = [SamplingParams(temperature=temperature, seed=7, max_tokens=60, structured_outputs=constraint)
                   for temperature in (0.0, 1.0) for constraint, _ in cases]
    outputs = generate(llm, [*constrained[:6], plain[0], *constrained[6:], plain[1]])
    mixed = [outputs[6], outputs[-1]]
    for output, expected in zip(mixed, alone):
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
        # The same token ids and ranks; the values to float32 rounding (a GPU's batched dots sum in another order).
        got, want = output.outputs[0].logprobs or [], expected.outputs[0].logprobs or []
        assert [{t: (lp.rank, lp.decoded_token) for t, lp in step.items()} for step in got] == \
            [{t: (lp.rank, lp.decoded_token) for t, lp in step.items()} for step in want]
        assert [lp.logprob for step in got for lp in step.values()] == pytest.approx(
            [lp.logprob for step in want for lp in step.values()], abs=1e-5)
    constrained_outputs = outputs[:6] + outputs[7:-1]
    for k, output in enumerate(constrained_outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (k, completion.text)
        cases[k % len(cases)][1](completion.text)


def test_the_mask_is_llguidance_s_allowed_set_at_every_step(llm, tiny):  # noqa: F811
    """With vLLM's default (raw) logprobs the masked logits are what is reported: the tokens with a
    finite logprob among the top 20 are exactly those an independent matcher allows at that step."""
    backend = GuidanceBackend(Tokenizer.from_file(str(tiny[0] / "tokenizer.json")), VOCAB, sorted(EOS_TOKEN_IDS))
    constraint = StructuredOutputsParams(regex=r"(ab|c){1,3}x?")
    outputs = generate(llm, [SamplingParams(temperature=1.0, seed=seed, max_tokens=20, logprobs=20,
                                            structured_outputs=constraint) for seed in range(3)])
    for output in outputs:
        completion, grammar = output.outputs[0], backend.compile(constraint)
        for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
            mask = np.zeros((1, bitmask_words(VOCAB)), np.int32)
            grammar.fill_bitmask(mask, 0)
            allowed = set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]).tolist())
            assert len(allowed) < 20  # so the top 20 reach past the allowed set
            assert {t for t, lp in logprobs.items() if math.isfinite(lp.logprob)} == allowed
            assert grammar.accept_tokens([token_id])
        assert completion.finish_reason == "stop" and re.fullmatch(r"(ab|c){1,3}x?", completion.text)


def test_each_of_n_completions_has_its_own_grammar(llm):  # noqa: F811
    schema = SCHEMAS[2]
    (output,) = generate(llm, [SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=40,
                                              guided_decoding=GuidedDecodingParams(json=schema))])
    texts = [c.text for c in output.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # they sampled apart, each from its own position in the grammar


def test_max_tokens_still_cuts_a_constrained_output(llm):  # noqa: F811
    (output,) = generate(llm, [SamplingParams(temperature=0.0, max_tokens=3,
                                              structured_outputs=StructuredOutputsParams(choice=["abcabcabcabcabc"]))])
    assert output.outputs[0].finish_reason == "length" and "abcabcabcabcabc".startswith(output.outputs[0].text)


@pytest.mark.parametrize("constraint, problem", [
    (StructuredOutputsParams(regex="(a"), "regex constraint does not compile"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), "json constraint does not compile"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "grammar constraint does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_alone(llm, constraint, problem):  # noqa: F811
    with pytest.raises(ValueError, match=problem):
        generate(llm, [SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(structured_outputs=constraint)])
    (output,) = generate(llm, [SamplingParams(temperature=0.0, max_tokens=4)])
    assert len(output.outputs[0].token_ids) == 4


def test_a_request_aborted_while_its_grammar_compiles_finishes_alone(llm):  # noqa: F811
    engine = llm.llm_engine
    engine.add_request("constrained", PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.abort_request("constrained")  # lands before the next step takes the compiled grammar
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((output.request_id, output.outputs[0]) for output in engine.step() if output.finished)
    assert (finals["constrained"].finish_reason, finals["constrained"].token_ids) == ("abort", [])
    assert len(finals["plain"].token_ids) == 3


def test_with_a_reasoning_parser_the_constraint_applies_after_the_thinking(llm, tiny, monkeypatch):  # noqa: F811
    """The core's grammars as `reasoning_parser="deepseek_r1"` makes them: a prompt that leaves the thinking
    open gets exactly its unconstrained tokens and logprobs; one whose thinking is closed gets the schema."""
    monkeypatch.setattr(llm.llm_engine.core, "structured", StructuredOutputManager(str(tiny[1]), VOCAB, "deepseek_r1"))
    tokenizer, schema = Tokenizer.from_file(str(tiny[0] / "tokenizer.json")), SCHEMAS[2]
    thinking, answering = ({"prompt_token_ids": tokenizer.encode(text).ids}
                           for text in ("the user asks <think>", "the user asks <think>a plan</think>"))
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    constrained = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3,
                                  structured_outputs=StructuredOutputsParams(json=schema)),
                   SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))]
    alone, still_thinking, answer = llm.generate([thinking, thinking, answering], [plain, *constrained], use_tqdm=False)
    assert "</think>" not in alone.outputs[0].text
    assert still_thinking.outputs[0].token_ids == alone.outputs[0].token_ids
    got, want = ([(t, lp.logprob) for step in output.outputs[0].logprobs for t, lp in step.items()]
                 for output in (still_thinking, alone))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-5)  # nothing masked
    assert answer.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.outputs[0].text), schema)
