"""BlockManager: the null block, step-by-step growth, refcounts, free, exhaustion."""

from types import SimpleNamespace

import pytest

from cbjax.core.kv.block_manager import NULL_BLOCK_ID, BlockManager
from cbjax.core.request import Request


def make_request(request_id: str, num_prompt_tokens: int) -> Request:
    params = SimpleNamespace(max_tokens=16, min_tokens=0, stop_token_ids=[], ignore_eos=False)
    return Request(request_id, list(range(num_prompt_tokens)), params)


def compute(request: Request, num_new_tokens: int) -> None:
    """What the scheduler does after a step: the allocated tokens are now computed."""
    request.num_computed_tokens += num_new_tokens


def test_blocks_needed_rounds_up():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert [manager.blocks_needed(n) for n in [0, 1, 4, 5, 8, 9]] == [0, 1, 1, 2, 2, 3]


def test_null_block_is_never_handed_out():
    manager = BlockManager(num_blocks=5, block_size=2)
    request = make_request("a", 8)
    assert manager.num_free_blocks == 4
    manager.allocate(request, 8)
    assert sorted(request.block_ids) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in request.block_ids
    assert manager.num_free_blocks == 0
    manager.check_invariants([request])


def test_allocate_grows_step_by_step():
    manager = BlockManager(num_blocks=10, block_size=4)
    request = make_request("a", 6)
    manager.allocate(request, 3)  # a first chunk of 3 tokens: one block
    assert len(request.block_ids) == 1
    compute(request, 3)
    manager.allocate(request, 1)  # token 4 still fits in block 1
    assert len(request.block_ids) == 1
    compute(request, 1)
    manager.allocate(request, 2)  # tokens 5-6 need a second block
    assert len(request.block_ids) == 2
    compute(request, 2)
    first_blocks = list(request.block_ids)
    manager.allocate(request, 1)
    compute(request, 1)
    assert request.block_ids[:2] == first_blocks, "growth never moves earlier blocks"
    assert manager.num_free_blocks == 9 - 2
    manager.check_invariants([request])


def test_refcounts_follow_ownership_and_free_returns_blocks():
    manager = BlockManager(num_blocks=6, block_size=2)
    a, b = make_request("a", 3), make_request("b", 4)
    manager.allocate(a, 3)
    manager.allocate(b, 4)
    assert all(manager.ref_counts[block] == 1 for block in a.block_ids + b.block_ids)
    manager.check_invariants([a, b])
    freed = list(a.block_ids)
    manager.free(a)
    assert a.block_ids == []
    assert all(manager.ref_counts[block] == 0 for block in freed)
    assert set(freed) <= set(manager.free_block_ids)
    assert manager.num_free_blocks == 5 - 2
    manager.check_invariants([a, b])


def test_exhaustion_refuses_and_allocate_without_check_raises():
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request("a", 4), make_request("b", 4)
    assert manager.can_allocate(a, 4)
    manager.allocate(a, 4)
    assert manager.can_allocate(b, 2)
    assert not manager.can_allocate(b, 3)
    with pytest.raises(RuntimeError, match="request b needs 2 more blocks; 1 are free"):
        manager.allocate(b, 3)
    assert b.block_ids == [], "a refused allocation takes nothing"
    manager.check_invariants([a, b])
    manager.free(a)
    assert manager.can_allocate(b, 4)


def test_can_allocate_counts_only_missing_blocks():
    manager = BlockManager(num_blocks=3, block_size=4)
    request = make_request("a", 8)
    manager.allocate(request, 8)  # both usable blocks
    assert manager.num_free_blocks == 0
    assert manager.can_allocate(request, 0)
    request.num_computed_tokens = 5
    assert manager.can_allocate(request, 3), "tokens 6-8 fit in blocks it already owns"
    assert not manager.can_allocate(request, 4)


def test_check_invariants_catches_double_ownership_and_lost_blocks():
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request("a", 2), make_request("b", 2)
    manager.allocate(a, 2)
    b.block_ids.append(a.block_ids[0])
    with pytest.raises(AssertionError, match="owned by a and b"):
        manager.check_invariants([a, b])
    with pytest.raises(AssertionError, match="neither free nor owned"):
        manager.check_invariants([])


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError, match="num_blocks is 1"):
        BlockManager(num_blocks=1, block_size=16)


def test_append_block_takes_the_next_free_block_or_reports_there_is_none():
    manager = BlockManager(num_blocks=3, block_size=2)
    request = make_request("a", 2)
    assert manager.append_block(request) and manager.append_block(request)
    assert request.block_ids == [1, 2]  # the free queue's order
    assert not manager.append_block(request), "the pool is empty"
    assert request.block_ids == [1, 2] and manager.num_free_blocks == 0
    manager.check_invariants([request])
