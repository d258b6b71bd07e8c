"""SamplingParams: vLLM's defaults, validation that names the field and range, normalisations."""

import dataclasses
import re

import pytest

from cbjax.sampling_params import (
    MAX_LOGPROBS, MAX_N, GuidedDecodingParams, SamplingParams, StructuredOutputsParams,
)


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (params.max_tokens, params.min_tokens, params.seed, params.logprobs) == (16, 0, None, None)
    assert (params.stop, params.stop_token_ids) == ([], [])
    assert (params.ignore_eos, params.skip_special_tokens, params.include_stop_str_in_output) == (False, True, False)
    assert not params.greedy and not params.has_penalties


@pytest.mark.parametrize("field, value, expected", [
    ("n", 0, r"n must be >= 1 \(completions per prompt\), got 0"),
    ("temperature", -0.1, r"temperature must be in \[0, inf\], got -0.1"),
    ("temperature", float("nan"), r"temperature must be a finite number"),
    # Numbers the sampler's float32 columns cannot hold (10**400 is not even a float: issue 35).
    ("temperature", float("inf"), r"temperature must be a finite number of magnitude at most 3.403e\+38, got inf"),
    ("temperature", 1e39, r"temperature must be a finite number"),
    ("temperature", 10**400, r"temperature must be a finite number.*got 1000000000"),
    ("repetition_penalty", float("inf"), r"repetition_penalty must be a finite number"),
    ("top_p", 10**400, r"top_p must be a finite number"),
    ("min_p", float("-inf"), r"min_p must be a finite number"),
    ("presence_penalty", -10**400, r"presence_penalty must be a finite number"),
    ("logit_bias", {5: 10**400}, r"logit_bias\[5\] must be a finite number"),
    ("logit_bias", {5: float("nan")}, r"logit_bias\[5\] must be a finite number"),
    ("n", MAX_N + 1, rf"n must be at most {MAX_N} \(completions per prompt\), got {MAX_N + 1}; send several requests"),
    ("n", 10**6, r"n must be at most"),
    ("seed", 2**63, r"seed must be in \[-9223372036854775808, 9223372036854775807\]"),
    ("seed", -(2**63) - 1, r"seed must be in"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
    ("top_k", -2, r"top_k must be -1 or 0 \(off\) or >= 1, got -2"),
    ("top_k", 2.5, r"top_k must be an int, got 2.5"),
    ("min_p", -0.01, r"min_p must be in \[0, 1\], got -0.01"),
    ("min_p", 1.01, r"min_p must be in \[0, 1\]"),
    ("seed", "7", r"seed must be an int"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ("presence_penalty", -2.5, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\], got -3.0"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, inf\], got 0.0"),
    ("max_tokens", 0, r"max_tokens must be >= 1 \(or None for up to max_model_len\), got 0"),
    ("min_tokens", -1, r"min_tokens must be >= 0, got -1"),
    ("min_tokens", 17, r"min_tokens must be <= max_tokens \(16\), got 17"),
    ("stop", "", r"stop must be a non-empty string"),
    ("stop", ["ok", 3], r"stop must be a non-empty string"),
    ("stop_token_ids", [2, -1], r"token ids of stop_token_ids must be >= 0, got -1"),
    ("stop_token_ids", [2, 3.0], r"a token id of stop_token_ids must be an int, got 3.0"),
    ("stop_token_ids", "7", r"stop_token_ids must be a list of token ids"),
    ("logprobs", MAX_LOGPROBS + 1, rf"logprobs must be in \[0, {MAX_LOGPROBS}\].*got {MAX_LOGPROBS + 1}"),
    ("logprobs", -1, r"logprobs must be in \[0, 20\]"),
])
def test_invalid_value_names_the_field_and_range(field, value, expected):
    with pytest.raises(ValueError, match=expected):
        SamplingParams(**{field: value})


def test_edge_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=0.01, max_tokens=1, min_tokens=1,
                   logprobs=MAX_LOGPROBS)
    SamplingParams(max_tokens=None, min_tokens=10_000)


def test_seed_leaves_room_for_each_completion():
    """Completion i samples from seed + i (vLLM's rule): the last one's seed is a 64-bit int too."""
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=2**63 - 4, n=4, temperature=1.0)
    with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 9223372036854775804\]"):
        SamplingParams(seed=2**63 - 3, n=4, temperature=1.0)


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]


def test_greedy_request_turns_filters_off_like_vllm():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert params.greedy
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).greedy


def test_has_penalties():
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_frozen_and_replace_revalidates():
    params = SamplingParams(max_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 9
    assert dataclasses.replace(params, max_tokens=9).max_tokens == 9
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(params, max_tokens=0)


@pytest.mark.parametrize("fields, given", [
    ({}, "none"),
    ({"json": {"type": "object"}, "regex": "a+"}, "['json', 'regex']"),
    ({"choice": ["a"], "json_object": True}, "['choice', 'json_object']"),
])
def test_structured_outputs_take_exactly_one_constraint(fields, given):
    with pytest.raises(ValueError, match=re.escape(given)):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize("fields, kind", [
    ({"json": '{"type": "object"}'}, "json"), ({"regex": "[0-9]+"}, "regex"), ({"choice": ["yes", "no"]}, "choice"),
    ({"grammar": 'start: "a"'}, "grammar"), ({"json_object": True}, "json_object"),
])
def test_structured_outputs_name_their_one_constraint(fields, kind):
    assert StructuredOutputsParams(**fields).kind == kind
    assert GuidedDecodingParams(**fields) == StructuredOutputsParams(**fields)  # vLLM's older spelling


@pytest.mark.parametrize("fields", [{"choice": []}, {"choice": "ab"}, {"choice": ["a", 1]}, {"regex": 5}, {"json": 3}])
def test_structured_outputs_reject_malformed_constraints(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        StructuredOutputsParams(**fields)
