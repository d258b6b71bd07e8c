"""Structured outputs on the host: constraint params, the llguidance backend's compile errors, mask exactness
against a hand-computed allowed set, and validity of random walks through the mask (a random model's worst case)."""

import json
import re

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from cbjax.core.structured.backend import bitmask_words
from cbjax.config import EngineConfig
from cbjax.core.structured.guidance import GuidanceBackend, _grammar_text_of_key
from cbjax.core.structured.reasoning import AfterReasoning, reasoning_ended
from cbjax.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from tiny_checkpoint import write_tiny_tokenizer

EOS = 2
VOCAB = 320  # wider than the tokenizer (as a model's padded logits are): the extra ids are never allowed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def backend(tokenizer) -> GuidanceBackend:
    return GuidanceBackend(tokenizer, VOCAB, [EOS])


def allowed(grammar) -> set[int]:
    mask = np.zeros((1, bitmask_words(VOCAB)), np.int32)
    grammar.fill_bitmask(mask, 0)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def random_walk(grammar, tokenizer, rng, max_tokens=200) -> str:
    """Pick uniformly among the allowed tokens (a random-logits model) until EOS or the grammar stops."""
    tokens = []
    for _ in range(max_tokens):
        if grammar.is_terminated():
            break
        token = int(rng.choice(sorted(allowed(grammar))))
        if token == EOS:
            assert grammar.is_accepting()
            break
        assert grammar.accept_tokens([token])
        tokens.append(token)
    else:
        pytest.fail(f"no end within {max_tokens} tokens: {tokenizer.decode(tokens)!r}")
    return tokenizer.decode(tokens)


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match=r"exactly one constraint.*got 2: \['json', 'regex'\]"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="got 0: none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice="yes")
    assert GuidedDecodingParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("params, problem", [
    (StructuredOutputsParams(regex="a("), "regex constraint does not compile"),
    (StructuredOutputsParams(json="{"), "json constraint does not compile: Expecting property name"),
    (StructuredOutputsParams(json={"type": "nonsense"}), "json constraint does not compile: Invalid type"),
    (StructuredOutputsParams(grammar="start: foo"), 'grammar constraint does not compile.*unknown name: "foo"'),
])
def test_compile_errors_name_the_problem(backend, params, problem):
    with pytest.raises(ValueError, match=problem):
        backend.compile(params)


def test_choice_mask_is_exactly_the_prefix_extending_tokens(backend, tokenizer):
    choices = ["yes", "no way", "maybe not"]
    grammar = backend.compile(StructuredOutputsParams(choice=choices))
    texts = {i: tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size()) if i > EOS}
    rng = np.random.default_rng(0)
    prefix = ""
    while True:
        expected = {i for i, t in texts.items() if t and any(c.startswith(prefix + t) for c in choices)}
        if prefix in choices:
            expected.add(EOS)
        assert allowed(grammar) == expected, prefix
        if not expected - {EOS}:
            break
        token = int(rng.choice(sorted(expected - {EOS})))
        assert grammar.accept_tokens([token])
        prefix += texts[token]
    assert prefix in choices


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                      "value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
     "required": ["code", "value"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2}},
     "required": ["path"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested-enum-array", "pattern-anyof", "defs-ref"])
def test_random_walks_through_json_schema_masks_are_valid(backend, tokenizer, schema):
    rng = np.random.default_rng(1)
    for _ in range(3):
        text = random_walk(backend.compile(StructuredOutputsParams(json=schema)), tokenizer, rng)
        jsonschema.validate(json.loads(text), schema)


def test_random_walks_through_regex_and_lark_masks_match(backend, tokenizer):
    rng = np.random.default_rng(2)
    regex = r"(add|def) [a-z]{1,5}\(\d\)"
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/ | "x"'
    for _ in range(3):
        assert re.fullmatch(regex, random_walk(backend.compile(StructuredOutputsParams(regex=regex)), tokenizer, rng))
        text = random_walk(backend.compile(StructuredOutputsParams(grammar=lark)), tokenizer, rng)
        assert re.fullmatch(r"\((\d{1,2}|x)(,(\d{1,2}|x))*\)", text), text
    text = random_walk(backend.compile(StructuredOutputsParams(json_object=True)), tokenizer, rng)
    assert isinstance(json.loads(text), dict)


def test_reset_restarts_the_grammar_for_a_recomputed_request(backend, tokenizer):
    grammar = backend.compile(StructuredOutputsParams(choice=["yes", "no"]))
    start = allowed(grammar)
    assert grammar.accept_tokens(tokenizer.encode("no").ids)
    assert allowed(grammar) == {EOS}
    grammar.reset()
    assert allowed(grammar) == start


def test_json_follows_the_schema_s_property_order(backend, tokenizer):
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9}, "alpha": {"type": "boolean"}}}
    text = random_walk(backend.compile(StructuredOutputsParams(json=schema)), tokenizer, np.random.default_rng(4))
    assert list(json.loads(text)) == ["zeta", "alpha"], text


def test_compiled_grammar_text_is_cached_by_constraint(backend):
    before = _grammar_text_of_key.cache_info().hits
    backend.compile(StructuredOutputsParams(regex="cached-[0-9]"))
    backend.compile(StructuredOutputsParams(regex="cached-[0-9]"))
    assert _grammar_text_of_key.cache_info().hits == before + 1


@pytest.mark.parametrize("text, ended", [
    ("", False), ("user: hi", False), ("assistant: <think>\n", False), ("<think>plan</think>", True),
    ("<think>\n\n</think>\n\n", True), ("<think>a</think> user: b <think>", False),
])
def test_the_last_thinking_marker_says_whether_reasoning_ended(text, ended):
    assert reasoning_ended(text) is ended


def test_a_grammar_after_reasoning_allows_every_token_until_think_closes(backend, tokenizer):
    """Forced reply tokens: a think block with JSON-breaking text, then the schema's JSON."""
    schema, every_token = SCHEMAS[0], set(range(VOCAB))
    params = StructuredOutputsParams(json=schema)
    decode = lambda token_id: tokenizer.decode([token_id])  # noqa: E731
    grammar = AfterReasoning(backend.compile(params), decode, reasoning_ended("user: hi <think>"))
    thinking = tokenizer.encode("plan: {not json} </think>").ids
    assert len(tokenizer.encode("</think>").ids) > 1  # the marker spans tokens here
    for token in thinking:
        assert allowed(grammar) == every_token  # EOS too: a reply may stop while thinking
        assert grammar.accept_tokens([token]) and not grammar.is_terminated()
    assert allowed(grammar) == allowed(backend.compile(params))  # the answer starts the schema afresh
    text = random_walk(grammar, tokenizer, np.random.default_rng(3))
    jsonschema.validate(json.loads(text), schema)
    grammar.reset()
    assert allowed(grammar) == every_token


def test_tokens_after_think_closes_in_one_step_go_to_the_grammar(backend, tokenizer):
    choice = StructuredOutputsParams(choice=["yes", "no"])
    grammar = AfterReasoning(backend.compile(choice), lambda t: tokenizer.decode([t]), False)
    assert grammar.accept_tokens(tokenizer.encode("hm</think>").ids + tokenizer.encode("no").ids)
    assert allowed(grammar) == {EOS}
    closed = AfterReasoning(backend.compile(choice), lambda t: tokenizer.decode([t]), reasoning_ended("<think></think>"))
    assert allowed(closed) == allowed(backend.compile(choice))  # the prompt closed it: constrained at once
    assert not closed.accept_tokens(tokenizer.encode("</think>").ids[:1])


def test_an_unknown_reasoning_parser_names_the_known_ones():
    with pytest.raises(ValueError, match=r"reasoning_parser='granite' is not known; choose one of \['deepseek_r1', 'qwen3'\]"):
        EngineConfig(model="unused", reasoning_parser="granite")
