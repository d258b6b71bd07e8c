"""Structured outputs on the real SmolLM2-135M-Instruct (a trained model's near-ties and long tokens,
where the tiny model's random logits are the other extreme): every output of a handful of JSON schemas,
regexes, a choice and a Lark grammar validates, greedy and sampled (jsonschema, re.fullmatch)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from cbjax import LLM, SamplingParams
from cbjax.sampling_params import StructuredOutputsParams

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct"  # scripts/fetch_model.sh
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}
POINTS = {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                              "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                             "y": {"type": "integer", "minimum": -9, "maximum": 9}}}},
          "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2}
IPV4 = r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"
SUM = 'start: NUMBER ("+" NUMBER)? ("+" NUMBER)?\nNUMBER: /[0-9]{1,3}/'
CASES = [  # (question, constraint, an independent check of the reply)
    ("Describe a person as JSON.", StructuredOutputsParams(json=PERSON),
     lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ("List one or two points as JSON.", StructuredOutputsParams(json=POINTS),
     lambda text: jsonschema.validate(json.loads(text), POINTS)),
    ("What is the date of the first moon landing?", StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
     lambda text: _check(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text), text)),
    ("Give the IP address of a home router.", StructuredOutputsParams(regex=IPV4),
     lambda text: _check(re.fullmatch(IPV4, text), text)),
    ("Is 'I love it' positive, negative or neutral?", StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
     lambda text: _check(text in ("positive", "negative", "neutral"), text)),
    ("Write a sum of small numbers.", StructuredOutputsParams(grammar=SUM),
     lambda text: _check(re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3}){0,2}", text), text)),
]


def _check(ok: object, text: str) -> None:
    assert ok, text


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    if not (CHECKPOINT / "config.json").exists():
        pytest.skip(f"{CHECKPOINT} is missing; run scripts/fetch_model.sh")
    # One compiled step (the C++ attention runs decode and mixed steps of 8 rows as one program): the
    # model's 30 layers take ~6 s to compile per step shape.
    return LLM(str(CHECKPOINT), max_num_seqs=8, max_model_len=256, max_num_batched_tokens=8, dtype="float32")


def test_every_constrained_reply_of_the_real_model_validates_greedy_and_sampled(smollm2):
    conversations = [[{"role": "user", "content": question}] for question, _, _ in CASES] * 2
    params = [SamplingParams(temperature=temperature, seed=11, max_tokens=48, structured_outputs=constraint)
              for temperature in (0.0, 1.0) for _, constraint, _ in CASES]
    outputs = smollm2.chat(conversations, params, use_tqdm=False)
    for k, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (k, completion.text)
        CASES[k % len(CASES)][2](completion.text)
