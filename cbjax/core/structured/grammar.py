"""A request's constraint as an llguidance grammar, checked against the model's tokenizer (vLLM's guidance backend)."""

import json

import llguidance
import llguidance.hf

from cbjax.sampling_params import StructuredOutputsParams


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint in llguidance's grammar format (a JSON schema, a regex, a choice, Lark, any JSON object)."""
    kind = params.kind
    if kind == "json":
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":  # a regex of the literal alternatives
        return llguidance.LLMatcher.grammar_from_regex("(" + "|".join(_escape(c) for c in params.choice) + ")")
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$*+?()[]{}|/-" else ch for ch in text)


def ll_tokenizer(hf_tokenizer, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over the HF `tokenizers` one the engine holds (EOS ends an accepted grammar)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=None, eos_token=eos_token_ids[0])


def compile_matcher(tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams) -> llguidance.LLMatcher:
    """A fresh matcher for one completion; a constraint that does not compile is a ValueError naming why."""
    grammar = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"structured outputs {params.kind} does not compile: {error}; fix the {params.kind}")
    return llguidance.LLMatcher(tokenizer, grammar)
