"""`cbjax bench host`: the real engine against a stand-in device of fixed step time, at a tiny size."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from tiny_checkpoint import make_tiny_checkpoint

from cbjax.bench.host import PASSAGE
from cbjax.bench.standin_device import DeviceTimeline, PendingResult, install_standin
from cbjax.entrypoints.cli.main import main
from cbjax.config import EngineConfig
from cbjax.engine.llm_engine import LLMEngine
from cbjax.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("host"), "llama")[1])


def test_device_queue_runs_steps_one_after_another_while_the_host_goes_on():
    # 200 ms steps: the two launches come back to back even on a busy machine.
    timeline = DeviceTimeline(0.2)
    first, second = timeline.launch("decode", 2), timeline.launch("decode", 2)
    # Launched back to back: the second waits for the first, as on a GPU stream.
    assert second.start == first.end == pytest.approx(first.start + 0.2)
    result = PendingResult(np.arange(3), second)
    assert not result.is_ready()  # the launches returned at once: the host is free
    start = time.perf_counter()
    assert np.asarray(result).tolist() == [0, 1, 2]
    assert time.perf_counter() >= second.end and time.perf_counter() - start >= 0.3


def test_standin_continues_the_passage_and_the_host_waits_for_the_device(checkpoint):
    engine = LLMEngine(EngineConfig(model=checkpoint, max_num_seqs=4, max_model_len=128, num_kv_blocks=40),
                       precompile=False, progress=False)
    passage = engine.tokenizer.encode(PASSAGE)
    timeline = install_standin(engine.runner, 0.004, passage)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": passage[:10]}, SamplingParams(max_tokens=5, ignore_eos=True))
    start = time.perf_counter()
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    elapsed = time.perf_counter() - start
    # The stand-in samples the passage's next token: positions 10..14 of the passage, as text too.
    assert [out.outputs[0].token_ids for out in finished] == [passage[10:15]] * 3
    assert finished[0].outputs[0].text == engine.tokenizer.decode(passage[10:15])
    # One prefill step (all three prompts) then four decode steps; each costs 4 ms of device time,
    # which the host's clock sees because it blocks on every step's result.
    assert [(s.kind, s.num_sampling_rows) for s in timeline.steps] == [("mixed", 3)] + [("decode", 3)] * 4
    assert all(s.end - s.start == pytest.approx(0.004) for s in timeline.steps)
    assert elapsed >= 5 * 0.004


def test_bench_host_reports_per_step_times_for_every_variant(checkpoint, tmp_path):
    path = tmp_path / "host.json"
    main([
        "bench", "host", "--model", checkpoint, "--num-running", "4", "--max-model-lens", "128", "256",
        "--delays-ms", "0", "3", "--variants", "greedy", "penalties+stop", "--output-kinds", "delta",
        "--prompt-len", "8", "--output-len", "6",
        "--async-scheduling", "on", "off", "--result-json", str(path),
    ])
    result = json.loads(path.read_text())
    runs = result["runs"]
    assert result["args"]["num_running"] == [4] and result["args"]["max_model_lens"] == [128, 256]
    # on and off side by side, alternating which goes first
    assert [(r["max_model_len"], r["variant"], r["delay_ms"], r["async_scheduling"]) for r in runs] == [
        (length, variant, delay, overlap)
        for length in (128, 256) for variant in ("greedy", "penalties+stop") for delay in (0, 3)
        for overlap in (("on", "off") if delay == 0 else ("off", "on"))
    ]
    for run in runs:
        # 4 requests x 6 tokens, never stopped by the stop strings; the 4 prompts (32 tokens) prefill in
        # the first step, which samples each first token, then 5 decode steps. Measured: decode steps
        # with a next step after them, 4 of the 5.
        assert run["num_output_tokens"] == 24 and run["num_requests_finished"] == 4
        assert run["finish_reasons"] == ["length"]
        assert run["num_steps"] == 6 and run["num_measured_steps"] == 4
        assert run["device_ms_per_step"] == pytest.approx(run["delay_ms"], abs=1e-6)
        # When the host's work is all hidden, the wall time is the device's: equal up to float rounding.
        assert run["wall_ms_per_step"] >= run["delay_ms"] - 1e-6
        # The synchronous loop's device always waits for the host; async scheduling may hide it all.
        assert (0 if run["async_scheduling"] == "on" else 1e-9) <= run["host_ms_per_step"] <= run["wall_ms_per_step"]
        assert run["elapsed_s"] >= run["num_steps"] * run["delay_ms"] / 1e3


def test_async_scheduling_launches_the_next_step_before_the_device_finishes(checkpoint):
    """With a 50 ms device step and about a millisecond of host work, the overlapped loop queues
    each decode step while the one before still runs (the device never waits: its next step starts
    the moment the last one ends); the synchronous loop reads every result first, so the device
    waits for the host between steps."""
    engine = LLMEngine(EngineConfig(model=checkpoint, max_num_seqs=4, max_model_len=128), precompile=False, progress=False)
    passage = engine.tokenizer.encode(PASSAGE)
    timeline = install_standin(engine.runner, 0.05, passage)
    gaps = {}
    for overlap in (True, False):
        engine.config.async_scheduling = overlap
        timeline.steps.clear()
        for i in range(3):
            engine.add_request(str(i), {"prompt_token_ids": passage[:10]}, SamplingParams(max_tokens=5, ignore_eos=True))
        finished = []
        while engine.has_unfinished_requests():
            finished += [out for out in engine.step() if out.finished]
        assert [out.outputs[0].token_ids for out in finished] == [passage[10:15]] * 3
        steps = timeline.steps
        gaps[overlap] = [later.start - earlier.end for earlier, later in zip(steps, steps[1:])]
    assert len(gaps[True]) == len(gaps[False]) == 4 and all(gap == 0 for gap in gaps[True])
    assert all(gap > 0 for gap in gaps[False])


def test_bench_host_staggered_requests_leave_one_by_one_and_every_decode_step_counts(checkpoint, tmp_path):
    path = tmp_path / "host.json"
    main([
        "bench", "host", "--model", checkpoint, "--num-running", "4", "--max-model-lens", "128", "--delays-ms", "0",
        "--variants", "greedy", "--output-kinds", "final_only", "--prompt-len", "8", "--output-len", "6",
        "--finish", "staggered", "--result-json", str(path),
    ])
    (run,) = json.loads(path.read_text())["runs"]
    # Output lengths 3, 4, 6 and 7 (spread over [6 / 2, 3 * 6 / 2)): 20 tokens. The prefill step samples
    # each first token, then 6 decode steps (the longest's 6 others), each one measured but the last.
    assert run["finish"] == "staggered" and run["num_output_tokens"] == 3 + 4 + 6 + 7
    assert run["num_steps"] == 7 and run["num_measured_steps"] == 5


def test_bench_host_with_the_engine_core_in_its_own_process(checkpoint, tmp_path):
    """--engine-process on off: the same workload with the core in a child process (its steps
    timed there, the outputs made here) and in this one, side by side; the same tokens come back."""
    path = tmp_path / "host.json"
    main([
        "bench", "host", "--model", checkpoint, "--num-running", "4", "--max-model-lens", "128", "--delays-ms", "0", "3",
        "--variants", "penalties+stop", "--output-kinds", "delta", "final_only", "--prompt-len", "8", "--output-len", "6",
        "--engine-process", "on", "off", "--result-json", str(path),
    ])
    runs = json.loads(path.read_text())["runs"]
    assert sorted((r["engine_process"], r["output_kind"], r["delay_ms"]) for r in runs) == sorted(
        (process, kind, delay) for process in ("on", "off") for kind in ("delta", "final_only") for delay in (0, 3))
    for run in runs:
        # As above: 4 x 6 tokens, never stopped, a prefill step then 5 decode steps, 4 measured.
        assert run["num_output_tokens"] == 24 and run["finish_reasons"] == ["length"]
        assert run["num_steps"] == 6 and run["num_measured_steps"] == 4
        assert run["device_ms_per_step"] == pytest.approx(run["delay_ms"], abs=1e-6)
        assert 0 <= run["host_ms_per_step"] <= run["wall_ms_per_step"]


def test_bench_host_with_a_stat_logger_runs_the_steps_in_the_servers_core_thread(checkpoint, tmp_path):
    """--stat-logger (issue 35): `cbjax serve`'s Prometheus logger attached, the steps come from a
    core thread as the server's; every request still runs to its length and is measured."""
    path = tmp_path / "host.json"
    main([
        "bench", "host", "--model", checkpoint, "--num-running", "4", "--max-model-lens", "128", "--delays-ms", "0",
        "--variants", "greedy", "--output-kinds", "final_only", "--prompt-len", "8", "--output-len", "6",
        "--stat-logger", "--result-json", str(path),
    ])
    (run,) = json.loads(path.read_text())["runs"]
    assert run["num_output_tokens"] == 24 and run["finish_reasons"] == ["length"]
    assert run["num_measured_steps"] > 0 and 0 <= run["host_ms_per_step"] <= run["wall_ms_per_step"]


def test_bench_host_runs_the_block_hashes_side_by_side_in_one_engine(checkpoint, tmp_path):
    """--prefix-caching-hash-algos sha256 builtin (issue 35): both hashes alternate in one engine, each
    run's setting names the one its pool used, and the outputs are the same."""
    path = tmp_path / "host.json"
    main([
        "bench", "host", "--model", checkpoint, "--num-running", "4", "--max-model-lens", "128", "--delays-ms", "0", "3",
        "--variants", "greedy", "--output-kinds", "final_only", "--prompt-len", "8", "--output-len", "6",
        "--prefix-caching-hash-algos", "sha256", "builtin", "--result-json", str(path),
    ])
    runs = json.loads(path.read_text())["runs"]
    assert [(r["delay_ms"], r["prefix_caching_hash_algo"]) for r in runs] == [
        (0, "sha256"), (0, "builtin"), (3, "builtin"), (3, "sha256")]
    assert all(r["num_output_tokens"] == 24 and r["num_measured_steps"] == 4 for r in runs)
    medians = json.loads(path.read_text())["medians"]
    assert sorted(m["prefix_caching_hash_algo"] for m in medians) == ["builtin", "builtin", "sha256", "sha256"]
