"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and meanings)."""

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from cbjax.arguments import UNSUPPORTED_SAMPLING_OPTIONS, check_int, check_number, describe, reject_unsupported

MAX_LOGPROBS = 20  # top-N logprobs per token a request may ask for
MAX_N = 128  # completions per prompt (OpenAI's bound on n): each is a request of its own
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM
# The sampler's columns are float32: a finite value beyond this would reach the device as inf.
FLOAT32_MAX = 3.4028234663852886e38
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed's range (the OpenAI server's, as vLLM's)
# Per-request widths of the sampler's fixed-shape columns (worker/sample/): the compiled steps hold this many.
MAX_LOGIT_BIAS = 16  # logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 32  # allowed_token_ids
MAX_BAD_WORD_SEQUENCES = 8  # token sequences of bad_words (each word tokenized with and without a leading space)
MAX_BAD_WORD_TOKENS = 5  # tokens of one such sequence

_check_int = check_int


def _check_finite(name: str, value: float) -> None:
    """A number that reaches the sampler as a finite float32 (NaN, inf, 1e39 and 10**400 do not)."""
    check_number(name, value)
    if not abs(value) <= FLOAT32_MAX:  # `not` also rejects NaN; an int too large for a float compares exactly
        raise ValueError(f"{name} must be a finite number of magnitude at most {FLOAT32_MAX:.4g}, got {describe(value)}")


def _check_range(name: str, value: float, low: float, high: float, *, open_low: bool = False) -> None:
    _check_finite(name, value)
    inside_low = value > low if open_low else value >= low
    if not (inside_low and value <= high):  # `not` also rejects NaN
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}")


def _check_token_id(name: str, token_id: object) -> None:
    _check_int(f"a token id of {name}", token_id)
    if token_id < 0:
        raise ValueError(f"token ids of {name} must be >= 0, got {token_id}")


def _check_count(what: str, count: int, limit: int) -> None:
    if count > limit:
        raise ValueError(f"{count} {what} given; the sampler holds at most {limit} per request; pass fewer")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names): a JSON schema, a regex, a choice of strings,
    a Lark grammar, or any JSON object; exactly one per request."""

    json: str | dict | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)
    json_object: bool | None = None  # True: any JSON object

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one constraint of {list(_CONSTRAINTS)}, got "
                             f"{len(given)}: {given or 'none'}; pass one")
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {describe(getattr(self, name))}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a JSON schema (a dict or its JSON text), got {describe(self.json)}")

    @property
    def kind(self) -> str:
        """The one constraint's name: json, regex, choice, grammar or json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name for the same fields


class RequestOutputKind(enum.Enum):
    """What each streamed RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping; validated and normalised on construction.

    Normalisations (as vLLM): top_k -1 -> 0 (off); stop str -> [str], None -> [];
    stop_token_ids None -> []; a greedy request (temperature < SAMPLING_EPS) has
    top_p 1, top_k 0 and min_p 0. Frozen: use `dataclasses.replace` to derive one.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None  # reduced modulo 2**32 on device
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None  # matched on detokenized text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per token, plus the sampled token's
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token, plus the prompt token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each engine output holds
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (before penalties)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words whose tokens may not be completed (see update_from_tokenizer)
    # bad_words as token sequences, set by update_from_tokenizer when the engine takes the request (an
    # init field only so that dataclasses.replace, which derives each completion's params, keeps it).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)
    # A JSON schema, regex, choice or grammar the output must match (vLLM's; guided_decoding= is its older name).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._validate()
        set_field = object.__setattr__  # frozen: normalise in place once, here
        if self.top_k == -1:
            set_field(self, "top_k", 0)
        set_field(self, "stop", [self.stop] if isinstance(self.stop, str) else list(self.stop or []))
        set_field(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.allowed_token_ids is not None:
            set_field(self, "allowed_token_ids", list(dict.fromkeys(self.allowed_token_ids)))
        if self.bad_words is not None:
            set_field(self, "bad_words", list(self.bad_words))
        if self.greedy:
            set_field(self, "top_p", 1.0)
            set_field(self, "top_k", 0)
            set_field(self, "min_p", 0.0)

    def _validate(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (completions per prompt), got {self.n}")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N} (completions per prompt), got {self.n}; "
                             "send several requests for more completions")
        _check_range("temperature", self.temperature, 0.0, float("inf"))
        _check_range("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _check_int("top_k", self.top_k)
        if self.top_k < -1:  # a top_k beyond the vocabulary keeps every token (the sampler clamps it)
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
            # Completion i of n samples from seed + i (parallel_sampling.py): each must be in range too.
            if not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
                raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX - (self.n - 1)}] (a 64-bit int, "
                                 f"less n - 1), got {self.seed}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), open_low=True)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1 (or None for up to max_model_len), "
                                 f"got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self._validate_stops()
        self._validate_token_lists()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {describe(self.structured_outputs)}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (or None for no logprobs), got {value}")

    def _validate_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if isinstance(self.stop_token_ids, (str, bytes, dict)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids or []:
            _check_token_id("stop_token_ids", token_id)

    def _validate_token_lists(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                _check_token_id("logit_bias", token_id)
                _check_finite(f"logit_bias[{token_id}]", bias)
            _check_count("logit_bias entries", len(self.logit_bias), MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes, dict)) or not hasattr(self.allowed_token_ids, "__iter__"):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")
            for token_id in self.allowed_token_ids:
                _check_token_id("allowed_token_ids", token_id)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty, which would forbid every token; "
                                 "give at least one token id, or None for no restriction")
            _check_count("allowed_token_ids", len(set(self.allowed_token_ids)), MAX_ALLOWED_TOKEN_IDS)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")

    def update_from_tokenizer(self, encode: Callable[[str], list[int]]) -> None:
        """Tokenize bad_words as vLLM does (encode adds no special tokens): each word without leading
        spaces, and with one leading space where that makes a different sequence of the same length
        (a word inside the text); the engine calls it once when it takes the request."""
        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            alone, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        for sequence in sequences:
            if len(sequence) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad word tokens {sequence} are {len(sequence)} tokens; at most "
                                 f"{MAX_BAD_WORD_TOKENS} are supported; use a shorter word")
        _check_count("bad_words token sequences (each word with and without a leading space)",
                     len(sequences), MAX_BAD_WORD_SEQUENCES)
        object.__setattr__(self, "bad_words_token_ids", sequences)  # frozen: derived once, like vLLM's

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError if a token id of stop_token_ids, logit_bias, allowed_token_ids or bad_words
        is outside the model's vocabulary [0, vocab_size) (the engine checks it when it takes the request)."""
        for name, token_ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                                ("bad_words", [t for s in self.bad_words_token_ids for t in s])):
            outside = sorted({t for t in token_ids if not 0 <= t < vocab_size})
            if outside:
                raise ValueError(f"token id(s) {outside} in {name} are outside the vocabulary [0, {vocab_size}); "
                                 "use ids from this model's tokenizer")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when presence, frequency or repetition penalty changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


_dataclass_init = SamplingParams.__init__


# A field SamplingParams has is supported, whatever the list says.
_UNSUPPORTED = {k: v for k, v in UNSUPPORTED_SAMPLING_OPTIONS.items() if k not in SamplingParams.__dataclass_fields__}


def _init_refusing_unsupported_vllm_options(self, *args, **kwargs) -> None:
    if kwargs.get("guided_decoding") is not None:  # vLLM's older spelling of structured_outputs
        if kwargs.get("structured_outputs") is not None:
            raise ValueError("both structured_outputs and guided_decoding given; pass one (guided_decoding is "
                             "the older name of structured_outputs)")
        kwargs["structured_outputs"] = kwargs.pop("guided_decoding")
    reject_unsupported("SamplingParams", kwargs.items(), _UNSUPPORTED)
    _dataclass_init(self, *args, **{k: v for k, v in kwargs.items() if k not in _UNSUPPORTED})


# vLLM users pass best_of=..., use_beam_search=...: say those are unsupported, not "unexpected keyword".
SamplingParams.__init__ = _init_refusing_unsupported_vllm_options
