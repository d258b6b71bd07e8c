"""Async scheduling (step N+1 launched before step N's tokens are read) gives exactly the outputs of
the synchronous loop: random workloads with stops found a step late, aborts while a step is in
flight, penalties, logprobs, n > 1, and a pool small enough to preempt. The synchronous loop is the
reference: it reads every token before scheduling the next step, as transformers-checked tests
elsewhere (test_engine.py) show it right."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from engine_helpers import COMPILES
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import SamplingParams
from cbjax.entrypoints.cli.args import add_engine_args, engine_options
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.sampling_params import StructuredOutputsParams

EOS_TOKEN_IDS = [2, 229]  # 229 is among the tiny model's likely tokens: requests really end on EOS
MAX_MODEL_LEN = 48
# One max_model_len request needs 12 blocks of 4; 20 make preemption common with 4 running.
OPTIONS = dict(max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, block_size=4, num_kv_blocks=20)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    _, checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("async"), "llama")
    (checkpoint / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": EOS_TOKEN_IDS}))
    return LLMEngine(EngineConfig(model=str(checkpoint), **OPTIONS), progress=False)


@st.composite
def requests(draw):
    """(prompt, params, abort after this many streamed tokens or None) per request."""
    result = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(3, 299), min_size=1, max_size=24))
        n = draw(st.sampled_from([1, 1, 2]))
        seeded = draw(st.booleans())
        max_tokens = draw(st.integers(1, min(14, MAX_MODEL_LEN - len(prompt))))
        params = SamplingParams(
            n=n,
            temperature=1.0 if seeded else 0.0,
            seed=draw(st.none() | st.integers(0, 1000)) if seeded else None,
            max_tokens=max_tokens,
            min_tokens=min(max_tokens, draw(st.sampled_from([0, 0, 2]))),
            stop_token_ids=draw(st.lists(st.integers(3, 299), max_size=3)),
            stop=draw(st.lists(st.sampled_from(["e", "th", "a", "zz"]), max_size=2)),
            ignore_eos=draw(st.booleans()),
            presence_penalty=draw(st.sampled_from([0.0, 0.5])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
            logprobs=draw(st.none() | st.integers(0, 2)),
            prompt_logprobs=draw(st.none() | st.just(1)),
        )
        abort_after = draw(st.none() | st.integers(1, 6)) if n == 1 else None
        result.append((prompt, params, abort_after))
    return result


def serve(engine: LLMEngine, workload: list, async_scheduling: bool | None,
          preempted: set[str] | None = None) -> dict[str, tuple]:
    """Run `workload` to the end from an empty prefix cache; each request's final output, in
    comparable form (and the ids of those preempted on the way into `preempted`, if given). A warm
    cache changes which prompt tokens are computed, and so the last bits of the logprobs: both
    modes must start from the same state for exact equality to hold."""
    assert engine.reset_prefix_cache()
    engine.config.async_scheduling = async_scheduling
    abort_after = {}
    for index, (prompt, params, abort) in enumerate(workload):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
        abort_after[f"r{index}"] = abort
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            limit = abort_after[output.request_id]
            if output.finished:
                final[output.request_id] = comparable(output)
                if preempted is not None and output.metrics.num_preemptions:
                    preempted.add(output.request_id)
            elif limit is not None and len(output.outputs[0].token_ids) >= limit:
                engine.abort_request(output.request_id)  # lands while a step for it is in flight
    return final


def comparable(output) -> tuple:
    def logprobs(positions):
        return None if positions is None else [
            None if p is None else {t: (lp.logprob, lp.rank) for t, lp in p.items()} for p in positions
        ]

    completions = [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs(c.logprobs),
         c.cumulative_logprob)
        for c in output.outputs
    ]
    return completions, logprobs(output.prompt_logprobs)


def assert_same_outputs(actual, expected) -> None:
    """Equal outputs: tokens, text, finish and stop reasons and ranks exactly; logprobs within 1e-4.
    The two loops pad their steps to different buckets, which moves a logprob in its last bits: a
    rounded comparison fails whenever a value sits on a rounding boundary."""
    if isinstance(expected, float):
        assert math.isclose(actual, expected, rel_tol=0, abs_tol=1e-4), (actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same_outputs(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), (actual, expected)
        for a, e in zip(actual, expected):
            assert_same_outputs(a, e)
    else:
        assert actual == expected


def assert_all_released(engine: LLMEngine) -> None:
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    manager.check_invariants([])
    assert engine.runner.slots.num_held == 0
    assert not engine.runner.sampling_constants  # each finished or aborted request's sampling columns (its seed) are dropped
    assert engine.in_flight is None and not engine.scheduler.has_unfinished_requests()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=requests())
def test_async_outputs_equal_the_synchronous_loop(engine, workload):
    synchronous = serve(engine, workload, async_scheduling=False)
    assert_all_released(engine)
    COMPILES.armed = True
    try:
        overlapped = serve(engine, workload, async_scheduling=True)
        assert_all_released(engine)
        # "auto" on a CPU: overlapping only while all 4 seats are taken, so it switches mid-run.
        switching = serve(engine, workload, async_scheduling=None)
    finally:
        COMPILES.armed = False
    assert_all_released(engine)
    assert COMPILES.count == 0
    assert_same_outputs(overlapped, synchronous)
    assert_same_outputs(switching, synchronous)


def test_auto_overlaps_on_a_cpu_only_while_every_seat_is_taken(engine):
    """async_scheduling=None: on a CPU a step is left in flight only when no seat is free; when a seat
    frees, the engine reads the step in flight before it schedules again, and nothing is lost. On an
    accelerator "auto" always overlaps."""
    engine.config.async_scheduling = None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("first", {"prompt_token_ids": [5, 6, 7]}, params)
        engine.step()
        on_cpu = engine.core.platform == "cpu"
        assert (engine.in_flight is None) == on_cpu  # 1 of 4 seats taken: synchronous on a CPU only
        for index in range(3):
            engine.add_request(f"more{index}", {"prompt_token_ids": [8 + index, 9]}, params)
        engine.step()
        assert engine.in_flight is not None  # all 4 taken: the step stays in flight
        tokens = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens[output.request_id] = output.outputs[0].token_ids
        assert sorted(tokens) == ["first", "more0", "more1", "more2"] and all(len(t) == 6 for t in tokens.values())
        assert_all_released(engine)
    finally:
        engine.config.async_scheduling = True  # the module's engine is shared: a failure here must not leak the mode


def test_stop_found_a_step_late_shows_no_extra_token(engine):
    """A request that samples EOS (ignore_eos=False) or hits max_tokens has a speculative step
    launched for it; the token that step samples is never shown, and its block is freed."""
    prompt = list(range(3, 40))  # 37 tokens: the next token starts a new block (block_size 4, 9 full)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.config.async_scheduling = True
    engine.add_request("long", {"prompt_token_ids": prompt}, greedy)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    (out,) = finals
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert_all_released(engine)
    # The same request stopped at its 3rd token by a stop id: exactly 3 tokens, the last the stop id.
    stop_id = out.outputs[0].token_ids[2]
    if stop_id in out.outputs[0].token_ids[:2]:
        pytest.skip("the tiny model repeated its token; the stop would come earlier")
    engine.add_request("stopped", {"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]))
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    (stopped,) = finals
    assert stopped.outputs[0].token_ids == out.outputs[0].token_ids[:3]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop_id)
    assert stopped.metrics.num_generation_tokens == 3
    assert math.isfinite(stopped.metrics.e2e_latency)
    assert_all_released(engine)


def test_constrained_requests_give_the_same_outputs_async_or_not_preempted_or_not(engine):
    """A constrained row's mask needs the token in flight: while a constrained request runs the
    engine reads each step before it schedules the next, so async scheduling changes no output; a
    preempted constrained request recomputes its tokens and goes on from where its grammar stood."""
    regex = "[a-e]{10,25}"
    plain = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    workload = [(list(range(3 + k, 23 + k)), plain, None) for k in range(2)]  # 12 blocks each of 20: they preempt
    workload += [(list(range(30 + k, 50 + k)), SamplingParams(temperature=1.0, seed=k, max_tokens=28,
                  structured_outputs=StructuredOutputsParams(regex=regex)), None) for k in range(3)]
    preempted = set()
    synchronous = serve(engine, workload, async_scheduling=False, preempted=preempted)
    assert preempted & {"r2", "r3", "r4"}  # a constrained request recomputed its tokens
    COMPILES.armed = True
    try:
        overlapped = serve(engine, workload, async_scheduling=True)
    finally:
        COMPILES.armed = False
        engine.config.async_scheduling = True
    assert_all_released(engine)
    assert COMPILES.count == 0
    assert_same_outputs(overlapped, synchronous)
    for request_id in ("r2", "r3", "r4"):
        (token_ids, text, finish_reason, *_), = synchronous[request_id][0]
        assert finish_reason == "stop" and re.fullmatch(regex, text), text


def test_async_scheduling_flags_follow_vllm():
    """vLLM's --async-scheduling / --no-async-scheduling on every serving command; on by default."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, expected in [([], True), (["--no-async-scheduling"], False), (["--async-scheduling"], True)]:
        assert engine_options(parser.parse_args(["--model", "m", *flags]))["async_scheduling"] is expected
    assert EngineConfig(model="m").async_scheduling is True


def test_server_defaults_favour_time_to_first_token():
    """`cbjax serve` and `cbjax worker` (which must compile what serve does): prompt-bucket midpoints on
    and async scheduling "auto"; the library keeps its defaults."""
    from cbjax.entrypoints.cli.main import build_parser

    for command in (["serve"], ["worker", "--model", "m"]):
        options = engine_options(build_parser().parse_args(command))
        assert options["prompt_bucket_midpoints"] is True and options["async_scheduling"] is None
        flags = ["--no-prompt-bucket-midpoints", "--async-scheduling"]
        options = engine_options(build_parser().parse_args([*command, *flags]))
        assert options["prompt_bucket_midpoints"] is False and options["async_scheduling"] is True
    library = engine_options(build_parser().parse_args(["generate", "--model", "m", "--prompt", "x"]))
    assert library["prompt_bucket_midpoints"] is False and library["async_scheduling"] is True
