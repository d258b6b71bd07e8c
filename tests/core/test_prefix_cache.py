"""Prefix caching in the block manager and scheduler: hand-worked cases, then a fake-model property test.

The fake model keeps a pool of "KV entries": the entry of position p is a digest of the tokens
0..p, so a request that reads a block of someone else's different prefix, or a stale or wiped
block, fails at once; its next token is a function of all its tokens, so every request's output
is known without running any scheduler (the independent expectation).
"""

import argparse
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from cbjax.config import EngineConfig
from cbjax.core.engine_core import EngineCore
from cbjax.core.kv.prefix_cache import HASH_ALGOS
from cbjax.entrypoints.cli.args import add_engine_args, engine_options
from cbjax.core.kv.block_manager import BlockManager
from cbjax.core.request import Request
from cbjax.core.sched.output import SchedulerOutput
from cbjax.core.sched.scheduler import Scheduler
from test_engine_core import StandInRunner
from test_scheduler import Params


def make_request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(request_id, tokens, Params(**params))


def compute(manager: BlockManager, request: Request, computed_blocks=None) -> None:
    """Admit `request` with `computed_blocks`, compute its whole prompt and register its full blocks."""
    num_new = request.num_tokens - len(computed_blocks or []) * manager.block_size
    manager.allocate(request, num_new, computed_blocks if computed_blocks is not None else [])
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


# ---- hand-worked ----------------------------------------------------------------------------


def test_a_shared_prefix_is_found_block_by_block_and_shared_by_refcount():
    manager = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_request("a", list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    compute(manager, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert manager.get_computed_blocks(b) == a.block_ids[:2]
    compute(manager, b, manager.get_computed_blocks(b))
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [manager.ref_counts[block] for block in a.block_ids] == [2, 2, 1]
    c = make_request("c", [0, 1, 2, 9, 4, 5, 6, 7, 8])  # differs in block 0: nothing after it counts
    assert manager.get_computed_blocks(c) == []
    manager.check_invariants([a, b])


def test_the_last_prompt_token_is_always_computed():
    manager = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    compute(manager, make_request("a", list(range(12))))
    # 8 tokens, both blocks cached: only the first is taken, so token 8 is computed for its logits.
    assert len(manager.get_computed_blocks(make_request("b", list(range(8))))) == 1
    assert len(manager.get_computed_blocks(make_request("c", list(range(9))))) == 2
    assert manager.get_computed_blocks(make_request("d", list(range(4)))) == []


def test_only_blocks_whose_kv_is_written_are_cached():
    manager = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_request("a", list(range(12)))
    manager.allocate(a, 12, [])
    a.num_computed_tokens = 6  # a first chunk: block 0 written, block 1 half written
    manager.cache_full_blocks(a)
    assert manager.get_computed_blocks(make_request("b", list(range(12)))) == a.block_ids[:1]


def test_freed_blocks_stay_cached_and_are_evicted_tail_first_after_unused_ones():
    manager = BlockManager(num_blocks=8, block_size=4, enable_caching=True)  # 7 usable
    a = make_request("a", list(range(14)))  # 3 full blocks + 1 partial
    compute(manager, a)
    prefix, tail = a.block_ids[:3], a.block_ids[3]
    manager.free(a)
    assert manager.num_free_blocks == 7
    again = make_request("again", list(range(14)))
    assert manager.get_computed_blocks(again) == prefix, "a finished request's blocks stay cached"
    # 3 never-used blocks and the unhashed partial tail go first, then a's full blocks, last first.
    taker = make_request("taker", [99] * 20)
    manager.allocate(taker, 20, [])
    assert set(taker.block_ids[:4]) == set(range(1, 8)) - set(prefix)
    assert tail in taker.block_ids[:4]
    assert taker.block_ids[4] == prefix[2], "the tail of a's prefix is evicted before its start"
    assert manager.get_computed_blocks(again) == prefix[:2]
    manager.check_invariants([taker])


def test_admission_counts_a_reused_free_cached_block_as_taken_from_the_pool():
    manager = BlockManager(num_blocks=6, block_size=4, enable_caching=True)  # 5 usable
    a = make_request("a", list(range(9)))
    compute(manager, a)
    cached = a.block_ids[:2]
    manager.free(a)  # its 3 blocks back in the queue, 2 of them cached
    hog = make_request("hog", [99] * 8)
    manager.allocate(hog, 8, [])  # 2 blocks: a's unhashed tail and a never-used block go first
    b = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])
    computed = manager.get_computed_blocks(b)
    assert computed == cached
    assert manager.num_free_blocks == 3
    # 2 new blocks are needed and 3 are free, but 2 of the free ones are b's own cached blocks.
    assert not manager.can_allocate(b, 5, computed)
    assert manager.can_allocate(b, 4, computed), "1 new block and the 2 cached ones fit"
    manager.allocate(b, 4, computed)
    assert manager.num_free_blocks == 0 and b.num_computed_tokens == 8
    manager.check_invariants([hog, b])


def test_penalised_and_prompt_logprob_requests_fill_the_cache_but_do_not_read_it():
    manager = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    compute(manager, make_request("a", list(range(9)), has_penalties=True))
    assert manager.get_computed_blocks(make_request("b", list(range(9)), has_penalties=True)) == []
    assert manager.get_computed_blocks(make_request("p", list(range(9)), prompt_logprobs=0)) == []
    assert len(manager.get_computed_blocks(make_request("c", list(range(9))))) == 2


def test_reset_prefix_cache_waits_for_an_idle_pool():
    manager = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_request("a", list(range(9)))
    compute(manager, a)
    assert not manager.reset_prefix_cache()
    assert len(manager.get_computed_blocks(make_request("b", list(range(9))))) == 2
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == []
    manager.check_invariants([])


def test_blocks_whose_python_hashes_collide_never_share_kv():
    """Issue 35 (vLLM's CVE-2025-25183): Python hashes an int modulo 2**61 - 1, so the blocks below
    have one 64-bit `hash` and the old hash served the victim's KV to the other prompt; sha256,
    the default, tells them apart."""
    victim, collider = [0, 1, 2, 3], [2**61 - 1, 1, 2, 3]
    assert hash(tuple(victim)) == hash(tuple(collider))
    for algo, shared in [("sha256", False), ("builtin", True)]:  # builtin: the attack is real
        manager = BlockManager(num_blocks=8, block_size=4, enable_caching=True, hash_algo=algo)
        compute(manager, make_request("victim", victim + [9]))
        assert bool(manager.get_computed_blocks(make_request("collider", collider + [9]))) is shared, algo
        assert len(manager.get_computed_blocks(make_request("same", victim + [8]))) == 1, algo


def test_the_default_block_hash_is_sha256_from_a_root_drawn_per_engine(monkeypatch):
    """vLLM's default and its seeding: a random root per engine start, one derived from
    PYTHONHASHSEED where that is set (engines with one seed then hash alike)."""
    assert EngineConfig(model="m").prefix_caching_hash_algo == "sha256"
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    first, second = BlockManager(8, 4, enable_caching=True), BlockManager(8, 4, enable_caching=True)
    hashes = [m.hasher.extend(make_request("a", list(range(9))), 4) for m in (first, second)]
    assert all(len(h) == 2 and all(isinstance(b, bytes) and len(b) == 32 for b in h) for h in hashes)
    assert hashes[0] != hashes[1]
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    seeded = [BlockManager(8, 4, enable_caching=True).hasher.extend(make_request("a", list(range(9))), 4) for _ in range(2)]
    assert seeded[0] == seeded[1] != hashes[0]
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='md5' is not one of 'sha256', 'builtin'"):
        EngineConfig(model="m", prefix_caching_hash_algo="md5")


def test_the_hash_option_reaches_the_engine_cores_pool():
    for algo in HASH_ALGOS:
        config = EngineConfig(model="stand-in", max_model_len=64, block_size=4, prefix_caching_hash_algo=algo)
        config.resolve(max_position_embeddings=64)
        core = EngineCore(config, StandInRunner(), SimpleNamespace(vocab_size=100), platform="cpu")
        assert core.block_manager.hasher.algo == algo


def test_scheduler_starts_a_cached_prompt_after_its_hit_and_counts_it_like_vllm():
    manager = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    scheduler = Scheduler(4, 64, 64, manager)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=1))
    scheduler.update(out := scheduler.schedule(), [5])
    assert [(i.num_new_tokens, i.start) for i in out.scheduled] == [(10, 0)]
    scheduler.add_request(make_request("b", list(range(10)), max_tokens=1))
    out = scheduler.schedule()
    assert [(i.request.request_id, i.num_new_tokens, i.start) for i in out.scheduled] == [("b", 2, 8)]
    assert out.scheduled[0].request.num_cached_tokens == 8
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (20, 8)


def test_a_held_request_waits_for_the_prompt_it_shares():
    manager = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    scheduler = Scheduler(4, 8, 64, manager)
    first, second = make_request("0_p", list(range(14))), make_request("1_p", list(range(14)))
    scheduler.add_request(first)
    scheduler.add_request(second, wait_for=first)
    assert scheduler.num_waiting == 2
    plans = []
    for token in (5, 6, 7):
        out = scheduler.schedule()
        plans.append([(i.request.request_id, i.num_new_tokens, i.start) for i in out.scheduled])
        scheduler.update(out, [token for i in out.scheduled if i.samples])
    # 14 prompt tokens in chunks of 8; then the second finds 3 cached blocks and computes 2 tokens.
    assert plans == [[("0_p", 8, 0)], [("0_p", 6, 8)], [("0_p", 1, 14), ("1_p", 2, 12)]]


# ---- property test against a fake model ----------------------------------------------------

BLOCK_SIZE = 4
MAX_MODEL_LEN = 40


def kv_entry(tokens: list[int]) -> int:
    return hash(tuple(tokens))


def next_token(tokens: list[int]) -> int:
    return kv_entry(tokens) % 7 + 3  # a small vocabulary, so unrelated requests share blocks too


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeModel:
    """Checks every KV entry a step reads, writes the new ones; wiped blocks hold None."""

    def __init__(self, num_blocks: int):
        self.pool = [[None] * BLOCK_SIZE for _ in range(num_blocks)]

    def run(self, output: SchedulerOutput) -> list[int]:
        # Every read before any write: stricter than the model, so a block cached before it is written fails.
        for reading in (True, False):
            for item in output.scheduled:
                request = item.request
                positions = range(item.start) if reading else range(item.start, item.start + item.num_new_tokens)
                for position in positions:
                    block, offset = request.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
                    want = kv_entry(request.all_token_ids[: position + 1])
                    if reading:
                        assert self.pool[block][offset] == want, (
                            f"{request.request_id} read a wrong KV entry at position {position} (block {block})"
                        )
                    else:
                        self.pool[block][offset] = want
        return [next_token(i.request.all_token_ids) for i in output.scheduled if i.samples]

    def wipe_unused(self, manager: BlockManager) -> None:
        for block in manager.free_block_ids:
            if manager.block_hashes[block] is None:
                self.pool[block] = [None] * BLOCK_SIZE


@st.composite
def workloads(draw):
    prefixes = [draw(st.lists(st.integers(3, 9), min_size=0, max_size=20)) for _ in range(draw(st.integers(1, 3)))]
    requests = []
    for index in range(draw(st.integers(2, 9))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(3, 9), min_size=1, max_size=8))
        requests.append(dict(
            request_id=f"r{index}",
            prompt=prompt,
            max_tokens=draw(st.integers(1, 10)),
            arrival_step=draw(st.integers(0, 6)),
            abort_step=draw(st.one_of(st.none(), st.integers(0, 12))),
            forks=draw(st.integers(1, 3)),  # completions of the prompt (n); the later ones wait for the first
            has_penalties=draw(st.booleans()) and draw(st.booleans()),
        ))
    return requests, draw(st.integers(11, 16)), draw(st.sampled_from([4, 8, 16]))


def serve(workload, num_blocks: int, budget: int, enable_caching: bool) -> dict[str, list[int]]:
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
    scheduler = Scheduler(4, budget, MAX_MODEL_LEN, manager)
    model, outputs, live = FakeModel(num_blocks), {}, []
    for step in range(500):
        for spec in workload:
            if spec["arrival_step"] == step:
                params = dict(max_tokens=spec["max_tokens"], has_penalties=spec["has_penalties"])
                children = [make_request(f"{k}_{spec['request_id']}", spec["prompt"], **params) for k in range(spec["forks"])]
                for child in children:
                    scheduler.add_request(child, children[0] if enable_caching and child is not children[0] else None)
                live += children
            if spec["abort_step"] == step:
                for k in range(spec["forks"]):
                    scheduler.abort_request(f"{k}_{spec['request_id']}")
        if step > 6 and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        scheduler.update(output, model.run(output))
        manager.check_invariants(scheduler.running)
        model.wipe_unused(manager)
        outputs.update({r.request_id: r.output_token_ids for r in live if r.status.finish_reason == "length"})
    assert not scheduler.has_unfinished_requests()
    manager.check_invariants([])
    assert all(count == 0 for count in manager.ref_counts), "a reference count did not return to zero"
    assert manager.num_free_blocks == manager.num_usable_blocks
    return outputs


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_caching_changes_no_output_under_preemption_eviction_and_aborts(case):
    workload, num_blocks, budget = case
    cached = serve(workload, num_blocks, budget, enable_caching=True)
    uncached = serve(workload, num_blocks, budget, enable_caching=False)
    for spec in workload:
        want = expected_output(spec["prompt"], spec["max_tokens"])
        for k in range(spec["forks"]):
            request_id = f"{k}_{spec['request_id']}"
            for outputs in (cached, uncached):
                if request_id in outputs:  # an aborted request has no "length" finish
                    assert outputs[request_id] == want, request_id
            if spec["abort_step"] is None:
                assert request_id in cached and request_id in uncached


def test_prefix_caching_flags_follow_vllm():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, expected in [([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)]:
        assert engine_options(parser.parse_args(["--model", "m", *flags]))["enable_prefix_caching"] is expected
    for flags, expected in [([], "sha256"), (["--prefix-caching-hash-algo", "builtin"], "builtin")]:
        assert engine_options(parser.parse_args(["--model", "m", *flags]))["prefix_caching_hash_algo"] == expected
