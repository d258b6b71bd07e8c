"""Compare one request's outputs from vLLM and cbjax; each difference becomes a `Disagreement`.

Both engines' outputs arrive as plain records (`record` in benchmarks/diff_vllm.py, the differential check):
{"prompt_token_ids", "outputs": [{"index", "text", "token_ids", "finish_reason", "stop_reason",
"logprobs": [[[token_id, logprob, rank, decoded], ...] per position] | None,
"cumulative_logprob"}], "prompt_logprobs": the same per prompt position (the first None) | None}
or {"error": message}.

Once the token ids diverge, everything after depends on the divergence, so text, reasons and
later logprobs of that output are not compared. The divergence is a near-tie (numerics, not a
defect) when vLLM's top two logprobs at that position are within NEAR_TIE (issue 10's rule).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
from typing import Any

NEAR_TIE = 0.02  # nats between vLLM's top two logprobs
LOGPROB_TOL = 2e-3  # float32 in both engines; different kernels and summation orders

Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Disagreement:
    case: str
    field: str
    kind: str  # "defect" | "near-tie"
    vllm: Any
    cbjax: Any
    detail: str = ""


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top_two_gap(position: list[list]) -> float | None:
    """Gap between the rank-1 and rank-2 logprobs of one position's entries; None without both."""
    by_rank = {rank: logprob for _, logprob, rank, _ in position if rank is not None}
    if 1 in by_rank and 2 in by_rank:
        return by_rank[1] - by_rank[2]
    return None


def compare_logprobs(case: str, field: str, vllm: list[list[list] | None], cbjax: list[list[list] | None] | None,
                     upto: int) -> list[Disagreement]:
    """Logprob dicts position by position (first `upto`): same token ids, values within tolerance, same ranks."""
    if cbjax is None:
        return [Disagreement(case, field, "defect", "present", None)]
    problems: dict[str, list[str]] = {}
    for pos, (v_pos, c_pos) in enumerate(zip(vllm[:upto], cbjax[:upto])):
        v_by_id = {e[0]: e for e in v_pos or []}  # None: the first prompt position, which has no logprobs
        c_by_id = {e[0]: e for e in c_pos or []}
        if v_by_id.keys() != c_by_id.keys():
            problems.setdefault("token set", []).append(f"pos {pos}: {sorted(v_by_id)} vs {sorted(c_by_id)}")
        for token_id in v_by_id.keys() & c_by_id.keys():
            (_, v_lp, v_rank, v_text), (_, c_lp, c_rank, c_text) = v_by_id[token_id], c_by_id[token_id]
            if not math.isclose(v_lp, c_lp, abs_tol=LOGPROB_TOL):
                problems.setdefault("value", []).append(f"pos {pos} token {token_id}: {v_lp:.4f} vs {c_lp:.4f}")
            if v_rank != c_rank:
                problems.setdefault("rank", []).append(f"pos {pos} token {token_id}: {v_rank} vs {c_rank}")
            if v_text != c_text:
                problems.setdefault("decoded_token", []).append(f"pos {pos} token {token_id}: {v_text!r} vs {c_text!r}")
    if len(vllm) != len(cbjax) and upto >= max(len(vllm), len(cbjax)):
        problems.setdefault("positions", []).append(f"{len(vllm)} vs {len(cbjax)}")
    return [
        Disagreement(case, f"{field}.{what}", "defect", None, None,
                     f"{len(examples)} mismatch(es), e.g. {'; '.join(examples[:2])}")
        for what, examples in problems.items()
    ]


def prompt_or_count_mismatch(case: str, vllm: Record, cbjax: Record) -> Disagreement | None:
    """Different prompt tokens or a different number of outputs: nothing further can be compared."""
    if vllm["prompt_token_ids"] != cbjax["prompt_token_ids"]:
        return Disagreement(case, "prompt_token_ids", "defect", vllm["prompt_token_ids"], cbjax["prompt_token_ids"])
    if len(vllm["outputs"]) != len(cbjax["outputs"]):
        return Disagreement(case, "len(outputs)", "defect", len(vllm["outputs"]), len(cbjax["outputs"]))
    return None


def compare_exact(case: str, vllm: Record, cbjax: Record, probe: Record | None) -> list[Disagreement]:
    """Greedy (or collapsed) requests: every field of every output must agree."""
    if mismatch := prompt_or_count_mismatch(case, vllm, cbjax):
        return [mismatch]
    found = []
    if vllm.get("prompt_logprobs") is not None:
        positions = len(vllm["prompt_token_ids"])
        found += compare_logprobs(case, "prompt_logprobs", vllm["prompt_logprobs"], cbjax.get("prompt_logprobs"), positions)
    for v, c in zip(vllm["outputs"], cbjax["outputs"]):
        i = v["index"]
        diverged = first_divergence(v["token_ids"], c["token_ids"])
        if diverged is not None:
            found.append(divergence(case, i, v, c, diverged, probe))
        else:
            for key in ("text", "finish_reason", "stop_reason"):
                if v[key] != c[key]:
                    found.append(Disagreement(case, f"outputs[{i}].{key}", "defect", v[key], c[key]))
            v_sum, c_sum = v["cumulative_logprob"], c["cumulative_logprob"]
            if (v_sum is None) != (c_sum is None) or (
                v_sum is not None and not math.isclose(v_sum, c_sum, abs_tol=LOGPROB_TOL * max(1, len(v["token_ids"])))
            ):
                found.append(Disagreement(case, f"outputs[{i}].cumulative_logprob", "defect", v_sum, c_sum))
        if v["logprobs"] is not None:
            upto = len(v["token_ids"]) if diverged is None else diverged
            found += compare_logprobs(case, f"outputs[{i}].logprobs", v["logprobs"], c["logprobs"], upto)
        elif c["logprobs"] is not None:
            found.append(Disagreement(case, f"outputs[{i}].logprobs", "defect", None, "present"))
    return found


def divergence(case: str, index: int, v: dict, c: dict, at: int, probe: Record | None) -> Disagreement:
    """A token divergence, classed near-tie from vLLM's top-2 logprobs at that position (its own or its probe's)."""
    if at in (len(v["token_ids"]), len(c["token_ids"])):  # one output is the other's prefix: a stopping difference
        return Disagreement(case, f"outputs[{index}].token_ids", "defect", v["token_ids"][at:at + 4], c["token_ids"][at:at + 4],
                            f"one engine stops after {at} tokens ({v['finish_reason']!r} vs {c['finish_reason']!r}); "
                            f"text {v['text']!r} vs {c['text']!r}")
    gap = None
    for source in (v, probe["outputs"][0] if probe and "outputs" in probe else None):
        if source and source["logprobs"] and len(source["logprobs"]) > at and source["token_ids"][:at] == v["token_ids"][:at]:
            gap = top_two_gap(source["logprobs"][at])
            if gap is not None:
                break
    kind = "near-tie" if gap is not None and gap < NEAR_TIE else "defect"
    detail = f"at output token {at}" + (f"; vLLM top-2 gap {gap:.4f}" if gap is not None else "")
    return Disagreement(case, f"outputs[{index}].token_ids", kind, v["token_ids"][at:at + 4], c["token_ids"][at:at + 4],
                        f"{detail}; text {v['text']!r} vs {c['text']!r}")


def compare_first_logprobs(case: str, vllm: Record, cbjax: Record, num_logprobs: int | None) -> list[Disagreement]:
    """Sampled requests: the number of outputs, their lengths and the first position's top-N logprobs."""
    if mismatch := prompt_or_count_mismatch(case, vllm, cbjax):
        return [mismatch]
    found = []
    for v, c in zip(vllm["outputs"], cbjax["outputs"]):
        i = v["index"]
        if len(v["token_ids"]) != len(c["token_ids"]):
            found.append(Disagreement(case, f"outputs[{i}].len(token_ids)", "defect", len(v["token_ids"]), len(c["token_ids"])))
        if v["logprobs"] and c["logprobs"]:
            # The engines sample different tokens: only the top-N (ranks 1..N) are fixed by the prompt.
            top = lambda pos: [e for e in pos if e[2] is not None and e[2] <= (num_logprobs or 0)]  # noqa: E731
            found += compare_logprobs(case, f"outputs[{i}].logprobs", [top(v["logprobs"][0])], [top(c["logprobs"][0])], 1)
            v_unranked, c_unranked = unranked_samples(v), unranked_samples(c)
            if v_unranked != c_unranked:
                found.append(Disagreement(case, f"outputs[{i}].logprobs.sampled_rank", "defect", v_unranked, c_unranked,
                                          "positions whose sampled token has no rank"))
        elif bool(v["logprobs"]) != bool(c["logprobs"]):
            found.append(Disagreement(case, f"outputs[{i}].logprobs", "defect", bool(v["logprobs"]), bool(c["logprobs"])))
    return found


def unranked_samples(output: dict) -> int:
    """How many positions give the sampled token's logprob without its rank."""
    return sum(
        any(e[0] == token_id and e[2] is None for e in position)
        for token_id, position in zip(output["token_ids"], output["logprobs"])
    )


def same_outputs(a: Record, b: Record) -> bool:
    strip = lambda r: [(o["token_ids"], o["text"]) for o in r.get("outputs", [])]  # noqa: E731
    return "error" not in a and "error" not in b and strip(a) == strip(b)


def compare_case(case: dict, vllm: dict[str, Record], cbjax: dict[str, Record]) -> list[Disagreement]:
    """All disagreements of one case, given each engine's records of every case by name."""
    name, mode = case["name"], case.get("compare", "exact")
    v, c = vllm[name], cbjax[name]
    if mode == "cbjax_extends" and "error" in v and "error" not in c:
        outputs = [(o["token_ids"], o["text"]) for o in c.get("outputs", [])]
        if len(set(map(repr, outputs))) == 1:
            return []  # an extension of vLLM's behaviour, and its greedy outputs agree with each other
        return [Disagreement(name, "greedy n outputs", "defect", "refused", outputs)]
    if "error" in v or "error" in c:
        if "error" in v and "error" in c:
            return []  # both refuse: agreement
        return [Disagreement(name, "refused", "defect", v.get("error", "accepted"), c.get("error", "accepted"))]
    if isinstance(mode, dict):
        other = mode["repeatable_with"]
        v_same, c_same = same_outputs(v, vllm[other]), same_outputs(c, cbjax[other])
        if v_same != c_same:
            return [Disagreement(name, f"repeatable_with {other}", "defect", v_same, c_same)]
        return []
    if mode == "first_logprobs":
        return compare_first_logprobs(name, v, c, case["params"].get("logprobs"))
    return compare_exact(name, v, c, vllm.get(f"{name}#probe"))


def probes(cases: list[dict]) -> list[dict]:
    """A logprobs=2 copy of each exactly-compared case asking for fewer, so vLLM's top-2 gap is known."""
    return [
        case | {"name": f"{case['name']}#probe", "params": case["params"] | {"logprobs": 2}}
        for case in cases
        if case.get("compare", "exact") == "exact" and (case["params"].get("logprobs") or 0) < 2
    ]


def reused_vllm_records(path: pathlib.Path, cases: list[dict]) -> dict:
    """vLLM's side from an earlier run, when it ran exactly these requests (vLLM does not change between runs; cbjax does)."""
    saved = json.loads(path.read_text())
    request = lambda case: {k: v for k, v in case.items() if k != "compare"}  # noqa: E731 - how it is compared is no request
    saved_cases = {c["name"]: request(c) for c in saved["cases"] + probes(saved["cases"])}
    stale = [c["name"] for c in cases if saved_cases.get(c["name"]) != request(c) or c["name"] not in saved["vllm"]]
    if stale:
        sys.exit(f"{path} has no vLLM record of the current {stale[:5]} ({len(stale)} cases); run without --reuse-vllm")
    return {"version": saved["summary"]["vllm_version"], "results": saved["vllm"]}
