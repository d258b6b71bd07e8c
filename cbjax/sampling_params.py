"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and meanings)."""

import enum
from dataclasses import dataclass

from cbjax.arguments import UNSUPPORTED_SAMPLING_OPTIONS, check_int, check_number, reject_unsupported

MAX_LOGPROBS = 20  # top-N logprobs per token a request may ask for
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM

_check_int = check_int


def _check_range(name: str, value: float, low: float, high: float, *, open_low: bool = False) -> None:
    check_number(name, value)
    inside_low = value > low if open_low else value >= low
    if not (inside_low and value <= high):  # `not` also rejects NaN
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value}")


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

    def __post_init__(self) -> None:
        self._validate()
        set_field = object.__setattr__  # frozen: normalise in place once, here
        if self.top_k == -1:
            set_field(self, "top_k", 0)
        set_field(self, "stop", [self.stop] if isinstance(self.stop, str) else list(self.stop or []))
        set_field(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.greedy:
            set_field(self, "top_p", 1.0)
            set_field(self, "top_k", 0)
            set_field(self, "min_p", 0.0)

    def _validate(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (completions per prompt), got {self.n}")
        _check_range("temperature", self.temperature, 0.0, float("inf"))
        _check_range("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
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
        for token_id in self.stop_token_ids or []:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")

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
    reject_unsupported("SamplingParams", kwargs.items(), _UNSUPPORTED)
    _dataclass_init(self, *args, **{k: v for k, v in kwargs.items() if k not in _UNSUPPORTED})


# vLLM users pass best_of=..., use_beam_search=...: say those are unsupported, not "unexpected keyword".
SamplingParams.__init__ = _init_refusing_unsupported_vllm_options
