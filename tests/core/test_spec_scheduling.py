"""The scheduler's side of speculative decoding, hand-worked: a request's drafts are scheduled after its
newest token with lookahead slots, its verified run is appended up to the first stop, and its
computed tokens roll back past the rejected drafts (whose blocks the prefix cache never registers)."""

from cbjax.core.kv.block_manager import BlockManager
from cbjax.core.request import Request, RequestStatus
from cbjax.core.sched.scheduler import Scheduler
from test_scheduler import Params, plan, step


def decoding(num_blocks=16, max_spec_batch_size=4, **params) -> tuple[Scheduler, Request]:
    """A scheduler (blocks of 4) with one request of 6 prompt tokens past its prompt step: 7 tokens, 6 computed."""
    scheduler = Scheduler(4, 16, 4 * (num_blocks - 1), BlockManager(num_blocks, 4, enable_caching=True), max_spec_batch_size=max_spec_batch_size)
    request = Request("a", [1, 2, 3, 4, 5, 6], Params(**params), [2])
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update(output, [9])
    return scheduler, request


def test_drafts_are_scheduled_with_lookahead_slots_and_rejected_ones_rolled_back():
    scheduler, request = decoding()
    request.spec_token_ids = [10, 11, 12, 13, 14]
    output = scheduler.schedule()
    assert plan(output) == [("a", 6, 6, True)] and output.spec_token_ids == {"a": [10, 11, 12, 13, 14]}
    assert len(request.block_ids) == 3 and request.spec_token_ids == []  # positions 6..11: a third block
    # the first draft accepted, then 20 sampled where 11 was drafted
    assert scheduler.update(output, [20], runs={"a": [10, 20]}) == []
    assert request.output_token_ids == [9, 10, 20] and request.num_computed_tokens == 8
    # blocks [1 2 3 4] and [5 6 9 10] are registered; the third, full of rejected drafts' KV, is not
    assert len(scheduler.block_manager.cached_blocks) == 2 and request.num_registered_blocks == 2
    output = scheduler.schedule()  # no drafts: a plain decode of 20 at position 8
    assert plan(output) == [("a", 1, 8, True)] and output.spec_token_ids == {}


def test_eos_inside_a_verified_run_ends_the_request_there():
    scheduler, request = decoding()
    request.spec_token_ids = [10, 2, 12]
    output = scheduler.schedule()
    run = [10, 2, 12, 13]  # every draft accepted, eos (2) among them
    assert scheduler.update(output, [13], runs={"a": run}) == [request]
    assert request.output_token_ids == [9, 10, 2] and run == [10, 2]
    assert request.status == RequestStatus.FINISHED_STOPPED and scheduler.block_manager.num_free_blocks == 15


def test_drafts_are_cut_to_max_tokens_and_dropped_for_a_large_batch():
    scheduler, request = decoding(max_tokens=3)
    request.spec_token_ids = [10, 11, 12]
    output = scheduler.schedule()  # 1 of 3 output tokens so far: 2 more at most, the newest's and one draft's
    assert output.spec_token_ids == {"a": [10]}
    run = [10, 11]
    assert scheduler.update(output, [11], runs={"a": run}) == [request]
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == [9, 10, 11]
    scheduler, request = decoding(max_spec_batch_size=0)
    request.spec_token_ids = [10, 11]
    output = scheduler.schedule()
    assert plan(output) == [("a", 1, 6, True)] and output.spec_token_ids == {} and request.spec_token_ids == []


def test_a_request_short_of_blocks_for_its_lookahead_preempts_the_last_running():
    # 3 usable blocks: "a" holds 2 (8 tokens once b joins), "b" 1; a's newest token and 3 drafts need a third
    scheduler, request = decoding(num_blocks=4)
    other = Request("b", [1, 2, 3], Params(), [2])
    scheduler.add_request(other)
    step(scheduler, 9)
    request.spec_token_ids = [10, 11, 12]
    output = scheduler.schedule()
    assert output.preempted_request_ids == ["b"] and output.spec_token_ids == {"a": [10, 11, 12]}
    assert len(request.block_ids) == 3 and other.num_computed_tokens == 0 and other.block_ids == []
