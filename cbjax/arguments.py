"""Argument checks shared by the public API: wrong types and vLLM options cbjax lacks, said plainly."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ArgumentTypeError(TypeError, ValueError):
    """A wrong type; also a ValueError, so `except ValueError` around bad input still catches it."""


# vLLM options cbjax does not implement, with vLLM's default (passing the default changes nothing).
UNSUPPORTED_SAMPLING_OPTIONS = {
    "best_of": None, "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "logits_processors": None, "guided_decoding": None,
    "truncate_prompt_tokens": None,
}
UNSUPPORTED_LLM_OPTIONS = {
    "trust_remote_code": False, "revision": None, "tokenizer_revision": None,
    "download_dir": None, "load_format": "auto", "pipeline_parallel_size": 1, "enforce_eager": False,
    "cpu_offload_gb": 0, "swap_space": 4, "hf_overrides": None,
    "tokenizer_mode": "auto", "skip_tokenizer_init": False,
}


def describe(value: Any) -> str:
    """`123 (int)`, `'hot' (str)`: what was given and its type."""
    shown = repr(value)
    return f"{shown if len(shown) <= 100 else shown[:100] + '...'} ({type(value).__name__})"


def check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number (int or float), got {describe(value)}")


def check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {describe(value)}")


def reject_unsupported(where: str, options: Iterable[tuple[str, Any]], unsupported: dict[str, Any]) -> None:
    """Refuse vLLM options cbjax lacks unless they are given at vLLM's default (which changes nothing)."""
    for name, value in options:
        if name in unsupported and value != unsupported[name]:
            raise ValueError(
                f"{where}({name}={value!r}) is a vLLM option that cbjax does not support; "
                f"leave it out (or at vLLM's default, {unsupported[name]!r})"
            )

