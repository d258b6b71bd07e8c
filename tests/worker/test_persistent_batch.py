"""A decode step over the previous step's rows is prepared by moving that step's inputs on one
position (cbjax/worker/persistent_batch.py), not row by row. The row-by-row `prepare` is the
reference: on random workloads (preemption, block boundaries, penalties, min_tokens, logprobs,
n > 1, aborts, both scheduling loops) every followed step's inputs equal the ones it builds, and
the engine's outputs are the same with following turned off."""

from __future__ import annotations

import copy
import json

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from engine.test_async_scheduling import EOS_TOKEN_IDS, OPTIONS, assert_all_released, requests, serve
from tiny_checkpoint import make_tiny_checkpoint

from cbjax.worker import model_runner as runner_module
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    _, checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("persistent"), "llama")
    (checkpoint / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": EOS_TOKEN_IDS}))
    return LLMEngine(EngineConfig(model=str(checkpoint), **OPTIONS), progress=False)


class CheckedPrepare:
    """Wraps the runner's prepare: each step is also prepared row by row (its state restored after),
    and a followed step's inputs are compared with those."""

    def __init__(self, runner, monkeypatch):
        self.runner, self.prepare = runner, runner.prepare
        self.num_followed = self.num_steps = self.num_followed_after_leaving = 0
        self.hit = False
        follow = runner_module.follow

        def recorded_follow(*args):
            followed = follow(*args)
            self.hit = followed is not None
            return followed

        monkeypatch.setattr(runner_module, "follow", recorded_follow)

    def __call__(self, scheduled):
        runner = self.runner
        # What prepare changes besides its result: the step it follows, and the slots and block-table
        # writes it hands out (the reference's writes must not count as sent).
        saved = runner._prepared, copy.deepcopy(runner.slots), copy.deepcopy(runner.table)
        runner.follow_decode_steps = False
        reference_bucket, reference = self.prepare(scheduled)
        runner._prepared, runner.slots, runner.table = saved
        runner.follow_decode_steps = True
        self.hit = False
        bucket, inputs = self.prepare(scheduled)
        self.num_steps += 1
        if self.hit:
            self.num_followed += 1
            assert bucket == reference_bucket
            self.check(scheduled, reference, inputs, saved[0])
        return bucket, inputs

    def check(self, scheduled, reference, followed, previous):
        num_rows = len(scheduled.scheduled)
        leaves = jax.tree_util.tree_leaves_with_path(reference)
        ours = dict(jax.tree_util.tree_leaves_with_path(followed))
        for path, expected in leaves:
            name = jax.tree_util.keystr(path)
            if name in (".token_ids", ".token_sources"):
                continue
            np.testing.assert_array_equal(ours[path], expected, err_msg=name)
        # Every row's token is taken on the device from its request's sampling row in the previous
        # step's output; the reference takes it from there too, or writes the token the host knows.
        previous_rows = {request: k for k, request in enumerate(previous.sampling_requests)}
        sources = np.array([previous_rows[row.request] for row in scheduled.scheduled])
        np.testing.assert_array_equal(followed.token_sources[:num_rows], sources)
        np.testing.assert_array_equal(followed.token_sources[num_rows:], reference.token_sources[num_rows:])
        np.testing.assert_array_equal(followed.token_ids, np.zeros_like(followed.token_ids))
        from_device = reference.token_sources[:num_rows] >= 0
        np.testing.assert_array_equal(reference.token_sources[:num_rows][from_device], sources[from_device])
        if not from_device.all():  # the host knew those tokens: the previous step sampled them (it has finished)
            last_sampled = np.asarray(self.runner.last_sampled)[sources]
            np.testing.assert_array_equal(last_sampled[~from_device], reference.token_ids[:num_rows][~from_device])
        if len(previous.requests) != num_rows:
            self.num_followed_after_leaving += 1


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=requests())
def test_followed_decode_steps_equal_row_by_row_ones(engine, workload):
    with pytest.MonkeyPatch.context() as monkeypatch:  # (hypothesis: no function-scoped fixture per example)
        run_checked(engine, workload, monkeypatch)


def run_checked(engine, workload, monkeypatch):
    checked = CheckedPrepare(engine.runner, monkeypatch)
    engine.runner.prepare = checked
    try:
        for async_scheduling in (False, True):
            serve(engine, workload, async_scheduling=async_scheduling)
            assert_all_released(engine)
    finally:
        del engine.runner.prepare  # the instance attribute: back to the method
        engine.config.async_scheduling = True


def test_long_decodes_follow_across_block_boundaries_and_outputs_match(engine, monkeypatch):
    """Four requests decoding together for many steps (each crosses several blocks of 4) and ending
    one after another: most steps follow the one before, also once some rows have left, their inputs
    check out, and turning following off changes no output."""
    from cbjax import SamplingParams

    workload = [
        ([3 + i, 40 + i, 7], SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=20 - 3 * i, ignore_eos=True,
                                            presence_penalty=0.5 * (i == 1), logprobs=1 if i == 2 else None), None)
        for i in range(4)
    ]
    checked = CheckedPrepare(engine.runner, monkeypatch)
    engine.runner.prepare = checked
    try:
        followed = {mode: serve(engine, workload, async_scheduling=mode) for mode in (False, True)}
    finally:
        del engine.runner.prepare
    assert checked.num_followed >= checked.num_steps // 2, (checked.num_followed, checked.num_steps)
    assert checked.num_followed_after_leaving >= 4, checked.num_followed_after_leaving
    engine.runner.follow_decode_steps = False
    try:
        row_by_row = serve(engine, workload, async_scheduling=False)
    finally:
        engine.runner.follow_decode_steps = True
        engine.config.async_scheduling = True
    assert followed[False] == row_by_row and followed[True] == row_by_row
    assert_all_released(engine)


def test_new_sampling_fields_follow_or_not_and_outputs_match(engine, monkeypatch):
    """logit_bias and allowed_token_ids rows follow (their columns travel with the row, also once
    a row has left); a bad_words row, whose columns change per step, has its steps built row by row.
    The outputs are the same with and without following and with async scheduling on and off (the
    newest output token a bad word's prefix is compared with comes from the device when the host
    does not have it yet)."""
    from cbjax import SamplingParams

    bad_words = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=["a", "the"])  # the longest
    bad_words.update_from_tokenizer(engine.tokenizer.encode_chat)
    following = [
        ([5, 9, 11], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={7: 2.5, 40: -3.0}), None),
        ([6, 8], SamplingParams(temperature=0.9, seed=4, max_tokens=9, ignore_eos=True,
                                allowed_token_ids=[7, 8, 9, 10, 40, 41]), None),
        ([12, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True), None),
    ]
    checked = CheckedPrepare(engine.runner, monkeypatch)
    engine.runner.prepare = checked
    try:
        followed = {mode: serve(engine, following, async_scheduling=mode) for mode in (False, True)}
        assert checked.num_followed >= checked.num_steps // 2, (checked.num_followed, checked.num_steps)
        assert checked.num_followed_after_leaving >= 1
        num_followed = checked.num_followed
        with_bad_words = {mode: serve(engine, following + [([7, 7, 7], bad_words, None)], async_scheduling=mode)
                          for mode in (False, True)}
        assert checked.num_followed == num_followed  # none: the bad_words row is in every step
    finally:
        del engine.runner.prepare
    engine.runner.follow_decode_steps = False
    try:
        assert followed[True] == followed[False] == serve(engine, following, async_scheduling=False)
        assert with_bad_words[True] == with_bad_words[False]
    finally:
        engine.runner.follow_decode_steps = True
        engine.config.async_scheduling = True
    assert set(followed[False]["r1"][0][0][0]) <= {7, 8, 9, 10, 40, 41}
    assert_all_released(engine)
