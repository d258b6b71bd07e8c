"""The differential check's comparison rules on hand-made records (issue 10's near-tie rule: 0.02)."""

from __future__ import annotations

import copy
import json

import pytest

from cbjax.bench.diff_compare import compare_case, probes, reused_vllm_records


def output(token_ids, text, finish="length", stop=None, logprobs=None, index=0) -> dict:
    return {"index": index, "text": text, "token_ids": token_ids, "finish_reason": finish, "stop_reason": stop,
            "logprobs": logprobs, "cumulative_logprob": None}


def record(*outputs, prompt=(1, 2, 3)) -> dict:
    return {"prompt_token_ids": list(prompt), "outputs": list(outputs)}


# Two positions with logprobs=1: [token, logprob, rank, decoded]; the sampled token first.
LOGPROBS = [[[10, -0.1, 1, "a"]], [[11, -0.5, 1, "b"]]]
GREEDY = {"name": "g", "prompt": "x", "params": {"temperature": 0.0, "logprobs": 1}}


def kinds(found) -> list[tuple[str, str]]:
    return [(d.field, d.kind) for d in found]


def test_identical_outputs_agree():
    v = record(output([10, 11], "ab", logprobs=LOGPROBS))
    assert compare_case(GREEDY, {"g": v}, {"g": copy.deepcopy(v)}) == []


def test_text_and_stop_reason_differences_are_defects():
    v = record(output([10, 2], "a", "stop", None, LOGPROBS))
    c = record(output([10, 2], "a</s>", "stop", 2, LOGPROBS))
    assert kinds(compare_case(GREEDY, {"g": v}, {"g": c})) == [
        ("outputs[0].text", "defect"), ("outputs[0].stop_reason", "defect")]


def test_a_divergence_is_a_near_tie_only_when_vllms_top_two_are_within_0_02():
    def vllm(gap):
        return record(output([10, 11], "ab", logprobs=[[[10, -0.1, 1, "a"]], [[11, -0.5, 1, "b"], [12, -0.5 - gap, 2, "c"]]]))

    cbjax = record(output([10, 12], "ac", logprobs=[[[10, -0.1, 1, "a"]], [[12, -0.52, 1, "c"], [11, -0.53, 2, "b"]]]))
    assert kinds(compare_case(GREEDY, {"g": vllm(0.019)}, {"g": cbjax})) == [("outputs[0].token_ids", "near-tie")]
    assert kinds(compare_case(GREEDY, {"g": vllm(0.3)}, {"g": cbjax})) == [("outputs[0].token_ids", "defect")]


def test_stopping_early_is_never_a_near_tie():
    v = record(output([10, 11], "ab", logprobs=[[[10, -0.1, 1, "a"]], [[11, -0.5, 1, "b"], [12, -0.51, 2, "c"]]]))
    c = record(output([10], "a", "stop", "a", logprobs=[[[10, -0.1, 1, "a"]]]))
    assert kinds(compare_case(GREEDY, {"g": v}, {"g": c})) == [("outputs[0].token_ids", "defect")]


def test_without_logprobs_the_probe_decides_the_near_tie():
    case = {"name": "g", "prompt": "x", "params": {"temperature": 0.0}}
    v = record(output([10, 11], "ab"))
    c = record(output([10, 12], "ac"))
    probe = record(output([10, 11], "ab", logprobs=[[[10, -0.1, 1, "a"]], [[11, -0.70, 1, "b"], [12, -0.71, 2, "c"]]]))
    assert kinds(compare_case(case, {"g": v, "g#probe": probe}, {"g": c})) == [("outputs[0].token_ids", "near-tie")]
    assert kinds(compare_case(case, {"g": v}, {"g": c})) == [("outputs[0].token_ids", "defect")]  # no evidence


def test_logprob_ranks_values_and_missing_entries_are_compared():
    v = record(output([10, 11], "ab", logprobs=[[[10, -0.1, 1, "a"]], [[11, -0.5, 7, "b"]]]))
    c = record(output([10, 11], "ab", logprobs=[[[10, -0.1, 1, "a"]], [[11, -0.4, None, "b"]]]))
    assert sorted(kinds(compare_case(GREEDY, {"g": v}, {"g": c}))) == [
        ("outputs[0].logprobs.rank", "defect"), ("outputs[0].logprobs.value", "defect")]
    c = record(output([10, 11], "ab", logprobs=[[[10, -0.1, 1, "a"]], [[11, -0.5, 7, "b"], [3, -0.2, 1, "z"]]]))
    assert kinds(compare_case(GREEDY, {"g": v}, {"g": c})) == [("outputs[0].logprobs.token set", "defect")]


def test_refusals_agree_only_when_both_refuse():
    refused = {"error": "ValueError: n must be 1"}
    ok = record(output([10], "a"))
    assert compare_case(GREEDY, {"g": refused}, {"g": {"error": "TypeError: other words"}}) == []
    assert kinds(compare_case(GREEDY, {"g": refused}, {"g": ok})) == [("refused", "defect")]


def test_sampled_requests_compare_the_prompts_top_n_and_the_output_count():
    case = {"name": "s", "prompt": "x", "compare": "first_logprobs", "params": {"n": 2, "logprobs": 1}}
    top = [[10, -0.1, 1, "a"]]
    v = record(output([10, 5], "a.", logprobs=[top, []]), output([4, 5], "d.", logprobs=[top + [[4, -3.0, 9, "d"]], []], index=1))
    c = record(output([10, 6], "a,", logprobs=[top, []]), output([7, 6], "e,", logprobs=[top + [[7, -2.0, 5, "e"]], []], index=1))
    assert compare_case(case, {"s": v}, {"s": c}) == []
    assert kinds(compare_case(case, {"s": v}, {"s": record(c["outputs"][0])})) == [("len(outputs)", "defect")]
    # vLLM ranks a sampled token outside the top N over the whole vocabulary; an engine giving no rank disagrees
    c["outputs"][1]["logprobs"][0][1][2] = None
    assert kinds(compare_case(case, {"s": v}, {"s": c})) == [("outputs[1].logprobs.sampled_rank", "defect")]


def test_repeatability_is_compared_between_the_engines():
    case = {"name": "again", "prompt": "x", "compare": {"repeatable_with": "first"}, "params": {}}
    one, two = record(output([1], "a")), record(output([2], "b"))
    assert compare_case(case, {"first": one, "again": one}, {"first": two, "again": two}) == []
    assert kinds(compare_case(case, {"first": one, "again": one}, {"first": one, "again": two})) == [
        ("repeatable_with first", "defect")]


def test_prompt_logprobs_are_compared_from_the_second_prompt_position():
    v = record(output([10], "a"))
    v["prompt_logprobs"] = [None, [[2, -1.0, 1, "b"], [9, -2.0, 2, "z"]], [[3, -0.5, 1, "c"]]]
    c = copy.deepcopy(v)
    assert compare_case(GREEDY | {"params": {}}, {"g": v}, {"g": c}) == []
    c["prompt_logprobs"][2] = [[3, -0.5, 4, "c"]]
    assert kinds(compare_case(GREEDY | {"params": {}}, {"g": v}, {"g": c})) == [("prompt_logprobs.rank", "defect")]
    del c["prompt_logprobs"]
    assert kinds(compare_case(GREEDY | {"params": {}}, {"g": v}, {"g": c})) == [("prompt_logprobs", "defect")]


def test_reused_vllm_records_must_cover_the_current_cases(tmp_path):
    case = {"name": "g", "prompt": "x", "params": {"temperature": 0.0, "max_tokens": 4}}
    records = {"g": record(output([10], "a")), "g#probe": record(output([10], "a"))}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"cases": [case], "vllm": records, "summary": {"vllm_version": "0.32.0"}}))
    assert reused_vllm_records(saved, [case] + probes([case]))["results"] == records
    changed = case | {"params": {"temperature": 0.0, "max_tokens": 5}}  # same name, different request
    with pytest.raises(SystemExit, match="no vLLM record of the current \\['g', 'g#probe'\\]"):
        reused_vllm_records(saved, [changed] + probes([changed]))


def test_a_greedy_n_that_vllm_refuses_must_give_equal_outputs_in_cbjax():
    case = {"name": "n", "prompt": "x", "params": {"temperature": 0.0, "n": 2}, "compare": "cbjax_extends"}
    refused = {"n": {"error": "n must be 1 when using greedy sampling"}}
    equal = record(output([10, 11], "ab"), output([10, 11], "ab", index=1))
    assert compare_case(case, refused, {"n": equal}) == []
    differing = record(output([10, 11], "ab"), output([10, 12], "ac", index=1))
    assert kinds(compare_case(case, refused, {"n": differing})) == [("greedy n outputs", "defect")]
