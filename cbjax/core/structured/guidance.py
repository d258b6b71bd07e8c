"""The llguidance backend (vLLM's `guidance` backend): Lark/JSON-schema/regex grammars over the engine's
HF `tokenizers` tokenizer, masks computed into numpy bitmasks."""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.numpy
import numpy as np
from jaxtyping import Int32
from tokenizers import Tokenizer

from cbjax.core.structured.backend import Grammar, StructuredOutputBackend
from cbjax.sampling_params import StructuredOutputsParams

# Compact JSON, no free whitespace between items: vLLM's guidance backend with disable_any_whitespace=True
# (its default allows any, which a weak model may fill until max_tokens).
_JSON_OPTIONS = {"whitespace_flexible": False}
_COMPILE_CACHE_SIZE = 256  # distinct constraints whose grammar text is kept


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for the one constraint params holds."""
    if params.kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if params.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if params.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(_escape_regex(c) for c in params.choice))
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


def _escape_regex(text: str) -> str:
    """text as a regex literal in llguidance's (Rust regex) syntax."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def check_constraint(params: StructuredOutputsParams) -> None:
    """ValueError naming the problem if params' constraint does not compile (no tokenizer needed: the
    engine checks it when it takes the request, before compiling it off the loop)."""
    error = llguidance.LLMatcher.validate_grammar(_cached_grammar_text(params), None)
    if error:
        raise ValueError(f"the {params.kind} constraint does not compile: {error}; fix the {params.kind}")


class GuidanceGrammar(Grammar):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._start = matcher.deep_copy()  # reset() restores this: llguidance's reset keeps no prompt state

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return self._matcher.consume_tokens(token_ids)

    def fill_bitmask(self, bitmask: Int32[np.ndarray, "rows words"], row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is complete (EOS allowed)."""
        return self._matcher.is_accepting()

    def reset(self) -> None:
        self._matcher = self._start.deep_copy()

    def fork(self) -> GuidanceGrammar:
        forked = GuidanceGrammar.__new__(GuidanceGrammar)
        forked._matcher, forked._start = self._matcher.deep_copy(), self._start
        return forked


class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        # vocab_size is the model's logits width, which may exceed the tokenizer's (padding rows).
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)

    def compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        grammar = _cached_grammar_text(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"the {params.kind} constraint does not compile: {error}; fix the {params.kind}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {params.kind} constraint does not compile: {matcher.get_error()}")
        return GuidanceGrammar(matcher)


@functools.lru_cache(maxsize=_COMPILE_CACHE_SIZE)
def _grammar_text_of_key(kind: str, key: str) -> str:
    return grammar_text(StructuredOutputsParams(**{kind: json.loads(key)}))


def _cached_grammar_text(params: StructuredOutputsParams) -> str:
    """grammar_text cached by the constraint (its kind and JSON text), as vLLM caches compiled grammars."""
    value = getattr(params, params.kind)
    try:  # keys unsorted: a schema's property order is the order its JSON must follow
        return _grammar_text_of_key(params.kind, json.dumps(value))
    except ValueError as error:  # grammar_from_json_schema raises on text that is not JSON
        raise ValueError(f"the {params.kind} constraint does not compile: {error}; fix the {params.kind}") from error
