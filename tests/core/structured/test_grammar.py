"""Constraints compiled to llguidance matchers over the tiny tokenizer: every completion driven by the
matcher's own mask (random choices among allowed tokens) satisfies the constraint, checked independently."""

import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest
from tiny_checkpoint import write_tiny_tokenizer
from transformers import AutoTokenizer

from cbjax.core.structured.grammar import compile_matcher, ll_tokenizer
from cbjax.sampling_params import StructuredOutputsParams

EOS = 2


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(hf_dir)
    hf = AutoTokenizer.from_pretrained(hf_dir)
    return hf, ll_tokenizer(hf, [EOS])


def _drive(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, hf, seed: int) -> str:
    """Sample uniformly among the tokens the mask allows until the grammar stops; the text produced."""
    rng, tokens = np.random.default_rng(seed), []
    for _ in range(300):
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)  # bit i of the packed words: token i
        allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[: tokenizer.vocab_size])
        token = int(rng.choice(allowed))
        if token == EOS:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
        if matcher.is_stopped():
            break
    else:
        pytest.fail("the grammar did not finish in 300 tokens")
    return hf.decode(tokens)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "tags": {"type": "array",
                   "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "tags"], "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_completions_validate(tokenizers, seed):
    hf, tok = tokenizers
    text = _drive(compile_matcher(tok, StructuredOutputsParams(json=SCHEMA)), tok, hf, seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_choice_completions_match(tokenizers, seed):
    hf, tok = tokenizers
    assert re.fullmatch(r"[0-9]{2,4}-x", _drive(compile_matcher(tok, StructuredOutputsParams(regex=r"[0-9]{2,4}-x")), tok, hf, seed))
    choices = ["yes", "no", "a.b (c)"]
    assert _drive(compile_matcher(tok, StructuredOutputsParams(choice=choices)), tok, hf, seed) in choices


def test_a_constraint_that_does_not_compile_names_itself(tokenizers):
    _, tok = tokenizers
    with pytest.raises(ValueError, match="regex does not compile"):
        compile_matcher(tok, StructuredOutputsParams(regex="(unclosed"))
