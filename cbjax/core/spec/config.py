"""speculative_config (vLLM's names and JSON form), checked once: a bad value names the field, the value and the limit."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
# Speculation is off on a step whose running batch exceeds this (vLLM's disable_by_batch_size). On this
# CPU with SmolLM2 a decode step's time grows nearly with its rows beyond 4, so verifying 1 + k tokens
# a row there costs more than the accepted drafts save (benchmarks/spec_decode.py).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts verified per request per step
    prompt_lookup_min: int = 5  # ngram: shortest suffix looked up (vLLM's default 5 when neither is given)
    prompt_lookup_max: int = 5  # ngram: longest suffix looked up
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # draft_model: the draft's checkpoint directory (same vocabulary as the target)
    draft_tensor_parallel_size: int = 1  # draft_model: the draft runs on one device
    # Each request drafts at most one token more than its last verification accepted, and one more after
    # each verification that accepted all (up to k; speculation.py). Off by default: at one request the
    # verify step is padded to 1 + k tokens anyway, and fewer drafts only forgo accepted tokens.
    adaptive_num_speculative_tokens: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not one of {METHODS}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"speculative_config method={self.method!r} with model={self.model!r}: method "
                             "'draft_model' takes the draft's checkpoint directory as model, the others take no model")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(f"speculative_config draft_tensor_parallel_size={self.draft_tensor_parallel_size!r} is not "
                             "supported: the draft model runs on one device; leave it out or set 1")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
        if not isinstance(self.adaptive_num_speculative_tokens, bool):
            raise ValueError(f"speculative_config adaptive_num_speculative_tokens="
                             f"{self.adaptive_num_speculative_tokens!r} must be true or false")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}; lower the first or raise the second")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ValueError(f"speculative_config suffix_decoding_max_tree_depth={self.suffix_decoding_max_tree_depth} "
                             "must be >= 2 (one matched token plus one proposed)")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(f"speculative_config suffix_decoding_max_cached_requests="
                             f"{self.suffix_decoding_max_cached_requests} must be >= 0 (0: no global cache)")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError(f"speculative_config suffix_decoding_max_spec_factor="
                             f"{self.suffix_decoding_max_spec_factor} must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(f"speculative_config suffix_decoding_min_token_prob="
                             f"{self.suffix_decoding_min_token_prob} must be in [0, 1]")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict or its JSON (`--speculative-config '{...}'`), with vLLM's defaults: ngram's lookup
        bounds default to each other (5 when neither is given), suffix's k to its tree depth."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config {value!r} is not JSON ({error}); pass an object such as "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {value!r}")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config keys {unknown} are not supported; it takes {sorted(fields)}")
        options = dict(value)
        if isinstance(options.get("model"), os.PathLike):
            options["model"] = os.fspath(options["model"])
        if "method" not in options and options.get("model") is not None:  # vLLM: a model alone means a draft model
            options["method"] = "draft_model"
        if "method" not in options:
            raise ValueError(f"speculative_config needs a method, one of {METHODS}")
        low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        if low is None and high is not None:
            options["prompt_lookup_min"] = high
        if high is None and low is not None:
            options["prompt_lookup_max"] = low
        if options.get("num_speculative_tokens") is None:
            if options["method"] != "suffix":
                raise ValueError(f"speculative_config method={options['method']!r} needs num_speculative_tokens")
            options["num_speculative_tokens"] = options.get("suffix_decoding_max_tree_depth", 24)
        return cls(**{k: v for k, v in options.items() if v is not None})
