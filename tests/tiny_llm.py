"""One tiny LLM shared by the output-semantics and beam-search tests: building one compiles for ~20 s.

A test module takes the fixtures by importing them: `from tiny_llm import llm, tiny  # noqa: F401`.

Its checkpoint lists token 229 as a second EOS (generation_config.json): 229 is among the tiny
model's likely tokens after some prompts, so beams and requests really end on EOS there.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from engine_helpers import ENGINE_OPTIONS
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM

EOS_TOKEN_IDS = {2, 229}


@functools.lru_cache(maxsize=1)
def tiny_llm(root: Path) -> tuple[Path, Path, LLM]:
    """(hf_dir, checkpoint, LLM over it), built once per test session under `root`."""
    hf_dir, checkpoint = make_tiny_checkpoint(root / "tiny-llm", "llama")
    (checkpoint / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": sorted(EOS_TOKEN_IDS)})
    )
    return hf_dir, checkpoint, LLM(str(checkpoint), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_llm(tmp_path_factory.getbasetemp())[:2]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return tiny_llm(tmp_path_factory.getbasetemp())[2]
