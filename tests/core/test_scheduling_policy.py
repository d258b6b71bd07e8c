"""Scheduling policies, hand-worked: who the scheduler admits next and whom it preempts, fcfs and priority."""

import pytest

from cbjax.config import EngineConfig
from cbjax.core.request import Request, RequestStatus
from test_scheduler import Params, make_scheduler, plan, step


def make_request(request_id: str, num_prompt_tokens: int, priority: int = 0, arrival_time: float = 0.0,
                 **params) -> Request:
    return Request(request_id, [1] * num_prompt_tokens, Params(**params), [], arrival_time, priority)


def admission_order(policy: str, requests: list[Request]) -> list[str]:
    """The order one seat (max_num_seqs=1) serves `requests`, each done after one token."""
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    for request in requests:
        scheduler.add_request(request)
    served = []
    while scheduler.has_unfinished_requests():
        output, finished = step(scheduler)
        served += [request.request_id for request in finished]
    return served


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["a", "b", "c", "d"]),  # the order of add_request: priority and arrival_time are not asked
    ("priority", ["d", "b", "a", "c"]),  # priority 0 first (d arrived before b), then 1 (a before c)
])
def test_admission_follows_priority_then_arrival(policy, expected):
    priorities = {"a": 1, "b": 0, "c": 1, "d": 0} if policy == "priority" else dict.fromkeys("abcd", 0)
    arrivals = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 0.5}
    requests = [make_request(name, 3, priorities[name], arrivals[name], max_tokens=1) for name in "abcd"]
    assert admission_order(policy, requests) == expected


@pytest.mark.parametrize("policy, served, preempted, waiting", [
    # Admission order a, b, c; a's block goes to c, the newest; then b has none and preempts itself.
    ("fcfs", "a", ["c", "b"], ["b", "c"]),
    # Admission by priority: c (0), a (1), b (2). c's block comes from b, the lowest priority; then a
    # has none and is itself the lowest left. Both go back by priority: a before b.
    ("priority", "c", ["b", "a"], ["a", "b"]),
])
def test_out_of_blocks_preempts_what_the_policy_gives_up_first(policy, served, preempted, waiting):
    # 3 usable blocks of 4 tokens: three 4-token prompts fill them; each one's 5th token needs a block.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=8, scheduling_policy=policy)
    priorities = {"a": 1, "b": 2, "c": 0} if policy == "priority" else dict.fromkeys("abc", 0)
    for arrival_time, name in enumerate("abc"):
        scheduler.add_request(make_request(name, 4, priorities[name], float(arrival_time)))
    output, _ = step(scheduler)
    assert sorted(request_id for request_id, *_ in plan(output)) == ["a", "b", "c"]
    assert scheduler.block_manager.num_free_blocks == 0

    output, _ = step(scheduler)
    assert plan(output) == [(served, 1, 4, True)]
    assert output.preempted_request_ids == preempted
    assert [request.request_id for request in scheduler.waiting] == waiting
    assert all(scheduler.requests[name].status == RequestStatus.PREEMPTED for name in preempted)
    scheduler.block_manager.check_invariants(scheduler.requests.values())


@pytest.mark.parametrize("policy, third_step, preempted", [
    ("fcfs", [("x", 1, 5, True)], ["y"]),  # y, the newest, preempts itself
    ("priority", [("y", 1, 4, True)], ["x"]),  # y, the more urgent, takes x's blocks though x came first
])
def test_a_later_more_urgent_request_preempts_an_earlier_running_one(policy, third_step, preempted):
    # 3 usable blocks of 4 tokens. x (4 prompt tokens) runs alone, then takes a 2nd block for its 5th;
    # y (4 prompt tokens) takes the last block; y's 5th token needs a block that only x can give.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=8, scheduling_policy=policy)
    urgent = policy == "priority"
    scheduler.add_request(make_request("x", 4, priority=5 if urgent else 0, arrival_time=0.0))
    step(scheduler)
    scheduler.add_request(make_request("y", 4, priority=0, arrival_time=1.0))
    output, _ = step(scheduler)
    assert plan(output) == [("x", 1, 4, True), ("y", 4, 0, True)]
    # The running list is in preemption order (the last goes first): admission order, or by priority.
    assert [request.request_id for request in scheduler.running] == (["y", "x"] if urgent else ["x", "y"])
    output, _ = step(scheduler)
    assert plan(output) == third_step
    assert output.preempted_request_ids == preempted
    scheduler.block_manager.check_invariants(scheduler.requests.values())


def test_equal_priorities_keep_arrival_order_and_a_preempted_request_its_place():
    scheduler = make_scheduler(scheduling_policy="priority")
    late, early, urgent = (make_request("late", 2, 1, 5.0), make_request("early", 2, 1, 1.0),
                           make_request("urgent", 2, 0, 9.0))
    for request in (late, early, urgent):
        scheduler.add_request(request)
    assert [request.request_id for request in scheduler.waiting] == ["urgent", "early", "late"]
    scheduler.abort_request("early")
    assert [request.request_id for request in scheduler.waiting] == ["urgent", "late"]
    assert early.status == RequestStatus.FINISHED_ABORTED


def test_fcfs_refuses_a_priority_it_would_ignore():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match=r"priority=3 is only allowed with scheduling_policy='priority'; "
                                         r"this engine's is 'fcfs'"):
        scheduler.add_request(make_request("a", 2, priority=3))
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("b", 2, priority=0))
    make_scheduler(scheduling_policy="priority").add_request(make_request("c", 2, priority=-4))


def test_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"scheduling_policy='lifo' is not one of \['fcfs', 'priority'\]"):
        make_scheduler(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy='sjf' is not one of"):
        EngineConfig(model="m", scheduling_policy="sjf")
    assert EngineConfig(model="m").scheduling_policy == "fcfs"
