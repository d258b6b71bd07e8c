"""Prefix caching and parallel sampling end to end on a tiny model.

Greedy outputs with caching on must equal those with caching off (which test_engine.py holds
to transformers), on shared-prefix workloads in a pool far smaller than their working set, with
the pool's unused blocks filled with NaN after every step, so reading a stale block shows.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams

BLOCK_SIZE = 8
ENGINE_OPTIONS = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, block_size=BLOCK_SIZE, dtype="float32")
SMALL_POOL = 16  # 15 usable blocks of 8 tokens: 120 tokens for workloads of several hundred
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("prefix"), "llama")[1])


@pytest.fixture(scope="module")
def cached(checkpoint):
    return LLM(checkpoint, **ENGINE_OPTIONS, num_kv_blocks=SMALL_POOL)


@pytest.fixture(scope="module")
def uncached(checkpoint):
    return LLM(checkpoint, **ENGINE_OPTIONS, num_kv_blocks=64, enable_prefix_caching=False)


def poison_unused_blocks(engine) -> None:
    """NaN into every block no request holds and no cache entry names, in every layer's pages."""
    manager, runner = engine.block_manager, engine.runner
    unused = [block for block in manager.free_block_ids if manager.block_hashes[block] is None]
    if unused:
        num_layers = runner.kv_pool[0].shape[1] // runner.num_blocks  # layer l's block b: page l * num_blocks + b
        pages = jnp.asarray([layer * runner.num_blocks + block for layer in range(num_layers) for block in unused])
        runner.kv_pool = tuple(p.at[:, pages].set(jnp.nan) for p in runner.kv_pool)


def drain(engine, arrivals: dict[int, list], aborts: dict[int, list[str]]) -> dict[str, list[int]]:
    """Step `engine`, adding (id, prompt, params) at their step and aborting ids at theirs; final token ids."""
    finished, step = {}, 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        for request_id in aborts.get(step, []):
            engine.abort_request(request_id)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        poison_unused_blocks(engine)
        step += 1
    return finished


def counting_prompt_tokens(engine) -> list[int]:
    """Make `engine` count the prompt tokens its steps compute; the one-element list holds the count."""
    count, dispatch = [0], engine.runner.dispatch

    def dispatch_and_count(scheduled):
        for row in scheduled.scheduled:
            count[0] += max(0, min(row.start + row.num_new_tokens, row.request.num_prompt_tokens) - row.start)
        return dispatch(scheduled)

    engine.runner.dispatch = dispatch_and_count
    return count


def check_pool_is_clean(engine) -> None:
    manager = engine.block_manager
    manager.check_invariants([])
    assert all(count == 0 for count in manager.ref_counts)
    assert manager.num_free_blocks == manager.num_usable_blocks


@st.composite
def shared_prefix_workloads(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    prefixes = [rng.integers(3, 300, size=n).tolist() for n in draw(st.lists(st.sampled_from([0, 5, 8, 16, 23, 40]), min_size=1, max_size=3))]
    requests = []
    for index in range(draw(st.integers(3, 8))):
        prompt = prefixes[draw(st.integers(0, len(prefixes) - 1))] + rng.integers(3, 300, size=draw(st.integers(1, 12))).tolist()
        requests.append((f"r{index}", prompt, draw(st.integers(0, 4)), draw(st.one_of(st.none(), st.integers(1, 8)))))
    return requests


@settings(max_examples=6, deadline=None)
@given(shared_prefix_workloads())
def test_greedy_outputs_are_the_same_with_caching_on_and_off(cached, uncached, workload):
    arrivals, aborts, unaborted = {}, {}, {}
    for request_id, prompt, arrival_step, abort_step in workload:
        arrivals.setdefault(arrival_step, []).append((request_id, prompt, GREEDY))
        if abort_step is not None:
            aborts.setdefault(arrival_step + abort_step, []).append(request_id)
        unaborted.setdefault(0, []).append((request_id, prompt, GREEDY))
    got = drain(cached.llm_engine, arrivals, aborts)
    want = drain(uncached.llm_engine, unaborted, {})
    for request_id, _, _, abort_step in workload:
        tokens = got[request_id].outputs[0].token_ids
        if abort_step is None:
            assert tokens == want[request_id].outputs[0].token_ids, request_id
        else:  # aborted: what it produced is the start of its full output
            assert tokens == want[request_id].outputs[0].token_ids[: len(tokens)], request_id
    check_pool_is_clean(cached.llm_engine)


def test_a_repeated_prompt_reads_its_cached_blocks_and_is_counted(cached, uncached):
    engine = cached.llm_engine
    assert cached.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(3, 24))}  # 21 tokens: 2 full blocks, then 5 tokens
    before = engine.get_stats()
    first = cached.generate(prompt, GREEDY, use_tqdm=False)[0]
    second = cached.generate(prompt, GREEDY, use_tqdm=False)[0]
    stats = engine.get_stats()
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 16)
    assert stats["prefix_cache_queries"] - before["prefix_cache_queries"] == 42
    assert stats["prefix_cache_hits"] - before["prefix_cache_hits"] == 16
    assert second.outputs[0].token_ids == uncached.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert cached.reset_prefix_cache()
    assert cached.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_n4_greedy_computes_the_prompt_once_and_gives_four_equal_completions(cached, uncached):
    assert cached.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(40, 61))}  # 21 tokens
    count = counting_prompt_tokens(cached.llm_engine)
    try:
        (out,) = cached.generate(prompt, SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        del cached.llm_engine.runner.dispatch
    # Once in full, then each other completion only its partial last block (21 - 16 tokens).
    assert count[0] == 21 + 3 * 5
    alone = uncached.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == alone and c.finish_reason == "length" for c in out.outputs)
    check_pool_is_clean(cached.llm_engine)


def test_n4_seeded_completions_differ_and_repeat_whatever_the_batch(cached):
    prompt = {"prompt_token_ids": list(range(100, 117))}
    seeded = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    alone = cached.generate(prompt, seeded, use_tqdm=False)[0]
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = cached.generate([{"prompt_token_ids": [5, 6, 7]}, prompt, {"prompt_token_ids": list(range(60))}],
                            [other, seeded, other], use_tqdm=False)[1]
    completions = [c.token_ids for c in alone.outputs]
    assert [c.token_ids for c in mixed.outputs] == completions
    assert len({tuple(c) for c in completions}) == 4, "each completion has its own random stream"


def test_penalised_n2_computes_its_prompt_per_completion(cached):
    assert cached.reset_prefix_cache()
    count = counting_prompt_tokens(cached.llm_engine)
    try:
        params = SamplingParams(n=2, temperature=0.0, presence_penalty=0.5, max_tokens=3, ignore_eos=True)
        (out,) = cached.generate({"prompt_token_ids": list(range(10, 31))}, params, use_tqdm=False)
    finally:
        del cached.llm_engine.runner.dispatch
    assert count[0] == 2 * 21 and out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_prompt_logprobs_n2_scores_its_whole_prompt_despite_a_cached_prefix(cached):
    prompt = {"prompt_token_ids": list(range(10, 31))}
    cached.generate(prompt, GREEDY, use_tqdm=False)  # its 2 full blocks are now cached
    count = counting_prompt_tokens(cached.llm_engine)
    try:
        params = SamplingParams(n=2, temperature=0.0, prompt_logprobs=0, max_tokens=3, ignore_eos=True)
        (out,) = cached.generate(prompt, params, use_tqdm=False)
    finally:
        del cached.llm_engine.runner.dispatch
    assert count[0] == 2 * 21 and out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == 21 and out.prompt_logprobs[0] is None
    assert all(len(entry) == 1 and token in entry for token, entry in zip(range(11, 31), out.prompt_logprobs[1:]))


def test_aborting_an_n3_request_returns_every_completion(cached):
    engine = cached.llm_engine
    engine.add_request("fan", {"prompt_token_ids": list(range(3, 20))}, SamplingParams(n=3, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request("fan")
    (out,) = [o for o in engine.step() if o.request_id == "fan"]
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    check_pool_is_clean(engine)


def test_requests_admitted_with_more_cached_blocks_than_a_step_writes_get_them_first(cached, uncached):
    """Four requests each find 10 cached blocks and decode from there in one step: 40 block-table
    entries, more than any step carries (cbjax/worker/block_table.py), so the surplus is written by
    write_table before the step; their outputs are the uncached engine's."""
    engine = cached.llm_engine
    assert cached.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(5, 86))}  # 81 tokens: 10 full blocks of 8, then 1
    cached.generate(prompt, GREEDY, use_tqdm=False)
    assert 4 * 10 > engine.runner.table_write_size
    calls, write_table = [], engine.runner.write_table
    engine.runner.write_table = lambda packed: (calls.append(packed), write_table(packed))
    try:
        outs = cached.generate([prompt] * 4, GREEDY, use_tqdm=False)
    finally:
        del engine.runner.write_table
    assert calls, "the surplus entries went out with write_table"
    alone = uncached.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert [out.num_cached_tokens for out in outs] == [80] * 4
    assert all(out.outputs[0].token_ids == alone for out in outs)
    check_pool_is_clean(engine)
