"""Scheduler: hand-worked steps of the vLLM V1 policy, then property tests against a fake model."""

import logging
import zlib
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.core.kv.block_manager import BlockManager
from cbjax.core.request import Request, RequestStatus
from cbjax.core.sched.output import SchedulerOutput
from cbjax.core.sched.policy import PriorityQueue, priority_key
from cbjax.core.sched.scheduler import Scheduler
from cbjax.lora.request import LoRARequest


@dataclass
class Params:
    """The SamplingParams fields the scheduler reads, with vLLM's names."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    has_penalties: bool = False
    prompt_logprobs: int | None = None


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                   max_model_len=64, **kwargs) -> Scheduler:
    return Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len,
                     BlockManager(num_blocks, block_size), **kwargs)


def make_request(request_id: str, num_prompt_tokens: int, eos_token_ids=(), **params) -> Request:
    return Request(request_id, [1] * num_prompt_tokens, Params(**params), list(eos_token_ids))


def plan(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, num_new_tokens, start, samples) per scheduled request, in order."""
    return [(item.request.request_id, item.num_new_tokens, item.start, item.samples)
            for item in output.scheduled]


def step(scheduler: Scheduler, token_id: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step whose model samples `token_id` for every request that samples."""
    output = scheduler.schedule()
    sampled = [token_id for item in output.scheduled if item.samples]
    return output, scheduler.update(output, sampled)


# ---- hand-worked steps ------------------------------------------------------------------


def test_a_request_whose_adapter_needs_a_slot_waits_until_running_adapters_free_one():
    """vLLM's max_loras rule: with 2 slots, a third adapter waits (and so does everyone behind it), while a
    request for a running adapter, or for the base model, is admitted; once one adapter's requests
    finish, the third takes its slot."""
    scheduler = make_scheduler(max_loras=2)
    lora = {name: LoRARequest(name, index + 1, f"/adapters/{name}") for index, name in enumerate("xyz")}
    requests = [make_request("x1", 3, max_tokens=1), make_request("y1", 3, max_tokens=5),
                make_request("x2", 3, max_tokens=5), make_request("base", 3, max_tokens=5),
                make_request("z1", 3, max_tokens=5), make_request("after", 3, max_tokens=5)]
    for request, adapter in zip(requests, [lora["x"], lora["y"], lora["x"], None, lora["z"], None]):
        request.lora_request = adapter
        scheduler.add_request(request)
    output, finished = step(scheduler)
    assert [row[0] for row in plan(output)] == ["x1", "y1", "x2", "base"] and finished == [requests[0]]
    output, _ = step(scheduler)  # x2 still runs under x: z waits, and "after" with it (nobody overtakes)
    assert "z1" not in [row[0] for row in plan(output)]
    scheduler.finish_request("x2", RequestStatus.FINISHED_ABORTED)
    output, _ = step(scheduler)
    assert [row[0] for row in plan(output)][-2:] == ["z1", "after"]


def test_allocated_names_the_requests_that_got_blocks_in_that_schedule():
    # Blocks of 4: "a" (3 prompt tokens) and "b" (2) get one block each when admitted; "a"'s decode
    # at position 3 still fits it, its next at position 4 needs a second block; "b" reaches position
    # 4 two steps later.
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 2))
    allocated, blocks_before = [], {}
    for _ in range(4):
        output, _ = step(scheduler)
        allocated.append([request.request_id for request in output.allocated])
        for item in output.scheduled:  # the others kept the blocks they had
            if item.request not in output.allocated:
                assert len(item.request.block_ids) == blocks_before[item.request.request_id]
        blocks_before = {item.request.request_id: len(item.request.block_ids) for item in output.scheduled}
    assert allocated == [["a", "b"], [], ["a"], ["b"]]


def test_update_reports_the_rows_it_skipped():
    # "b" is aborted after its step was scheduled: update drops its token and names it.
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 3))
    output = scheduler.schedule()
    scheduler.abort_request("b")
    skipped = []
    scheduler.update(output, [7, 7], skipped)
    assert [request.request_id for request in skipped] == ["b"]
    assert scheduler.requests["a"].output_token_ids == [7]


def test_token_budget_is_split_between_decodes_and_a_chunked_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 2))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 3, 0, True), ("b", 2, 0, True)]
    assert not output.is_decode_only

    scheduler.add_request(make_request("c", 30))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 3, True), ("b", 1, 2, True), ("c", 14, 0, False)]
    assert output.num_scheduled_tokens == 16
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 4, True), ("b", 1, 3, True), ("c", 14, 14, False)]
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 5, True), ("b", 1, 4, True), ("c", 2, 28, True)]
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 6, True), ("b", 1, 5, True), ("c", 1, 30, True)]
    assert output.is_decode_only


@pytest.mark.parametrize("chunked, second_step", [
    (True, [("a", 1, 3, True), ("b", 1, 2, True), ("c", 30, 0, False)]),
    (False, [("a", 1, 3, True), ("b", 1, 2, True)]),  # c's 31 tokens exceed the 30 left
])
def test_unchunked_prompt_waits_for_a_budget_that_holds_it_whole(chunked, second_step):
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=32,
                               enable_chunked_prefill=chunked)
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    scheduler.add_request(make_request("b", 2, max_tokens=2))
    step(scheduler)
    scheduler.add_request(make_request("c", 31, max_tokens=1))
    scheduler.add_request(make_request("d", 1, max_tokens=1))
    output, finished = step(scheduler)
    assert plan(output) == second_step
    assert [request.request_id for request in finished] == ["a", "b"]
    if not chunked:
        assert scheduler.num_waiting == 2, "d does not overtake c at the head of the queue"
        output, _ = step(scheduler)
        assert plan(output) == [("c", 31, 0, True), ("d", 1, 0, True)]


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 2, max_tokens=2))
    output, _ = step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    output, finished = step(scheduler)
    assert plan(output) == [("a", 1, 2, True), ("b", 1, 2, True)]
    assert len(finished) == 2
    output, _ = step(scheduler)
    assert plan(output) == [("c", 2, 0, True)]


def test_max_num_prefills_holds_back_prompt_chunks_but_not_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_num_prefills=2)
    scheduler.add_request(make_request("a", 3, max_tokens=3))
    step(scheduler)
    for request_id in "bcd":
        scheduler.add_request(make_request(request_id, 4, max_tokens=1))
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 3, True), ("b", 4, 0, True), ("c", 4, 0, True)]
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 4, True), ("d", 4, 0, True)]
    with pytest.raises(ValueError, match="max_num_prefills is 0; it must be at least 1"):
        make_scheduler(max_num_prefills=0)


def test_long_prefill_token_threshold_caps_each_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=4)
    scheduler.add_request(make_request("a", 10))
    chunks = [plan(step(scheduler)[0]) for _ in range(3)]
    assert chunks == [[("a", 4, 0, False)], [("a", 4, 4, False)], [("a", 2, 8, True)]]


def test_out_of_blocks_preempts_the_newest_request_and_admits_nobody(caplog):
    # 4 usable blocks of 2 tokens: a and b each fill 2 after their prompts.
    scheduler = make_scheduler(num_blocks=5, block_size=2, max_model_len=8)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, token_id=10)
    scheduler.add_request(make_request("c", 1))

    with caplog.at_level(logging.INFO, logger="cbjax.core.sched.scheduler"):
        output, _ = step(scheduler, token_id=11)  # a's 5th token needs a 3rd block
    assert plan(output) == [("a", 1, 4, True)]
    assert output.preempted_request_ids == ["b"]
    assert "preempted request b: 5 tokens to recompute" in caplog.text
    assert [request.request_id for request in scheduler.waiting] == ["b", "c"]
    assert (b.status, b.num_computed_tokens, b.block_ids) == (RequestStatus.PREEMPTED, 0, [])
    assert b.num_preemptions == scheduler.num_preemptions == 1
    assert scheduler.block_manager.num_free_blocks == 1, "c could fit, yet waits this step"

    output, finished = step(scheduler, token_id=12)  # b needs 3 blocks for 5 tokens; 1 is free
    assert plan(output) == [("a", 1, 5, True)]
    assert finished == [a]
    output, _ = step(scheduler, token_id=13)
    assert plan(output) == [("b", 5, 0, True), ("c", 1, 0, True)]
    assert not output.is_decode_only, "recomputing a preempted request is not a decode"
    assert b.status == RequestStatus.RUNNING
    assert b.all_token_ids == [1, 1, 1, 1, 10, 13], "b continues after its first output token"
    scheduler.block_manager.check_invariants(scheduler.requests.values())


def test_request_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    scheduler = make_scheduler(num_blocks=5, block_size=2, max_model_len=8)
    scheduler.add_request(make_request("a", 5))  # 3 blocks; its 6th token fits the 3rd
    scheduler.add_request(make_request("b", 2))  # 1 block; its 3rd token needs another
    step(scheduler)
    output, _ = step(scheduler)
    assert plan(output) == [("a", 1, 5, True)]
    assert output.preempted_request_ids == ["b"]
    assert scheduler.num_running == 1


def test_abort_frees_blocks_and_removes_the_request():
    scheduler = make_scheduler()
    a, b = make_request("a", 9), make_request("b", 3)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    assert scheduler.block_manager.num_free_blocks == 63 - 3
    assert scheduler.abort_request("a") is a
    assert scheduler.abort_request("b") is b, "a waiting request can be aborted too"
    assert (a.status.finish_reason, b.status.finish_reason) == ("abort", "abort")
    assert a.block_ids == [] and a.finished_time is not None
    assert scheduler.block_manager.num_free_blocks == 63
    assert not scheduler.has_unfinished_requests()
    assert scheduler.abort_request("a") is None
    assert scheduler.abort_request("never-added") is None


def test_finish_request_stops_a_running_request_for_the_engine():
    scheduler = make_scheduler()
    request = make_request("a", 3)
    scheduler.add_request(request)
    step(scheduler)
    assert scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED) is request
    assert request.status.finish_reason == "stop" and request.block_ids == []
    assert scheduler.num_running == 0
    with pytest.raises(ValueError, match="RUNNING is not a finished status"):
        scheduler.finish_request("a", RequestStatus.RUNNING)


@pytest.mark.parametrize("params, tokens, expected_output, expected_reason", [
    ({}, [5, 2, 7], [5, 2], "stop"),  # eos
    ({"min_tokens": 3}, [5, 2, 7, 2], [5, 2, 7, 2], "stop"),  # eos ignored until 3 tokens
    ({"ignore_eos": True, "max_tokens": 3}, [2, 2, 2], [2, 2, 2], "length"),
    ({"stop_token_ids": [9]}, [5, 9, 7], [5, 9], "stop"),
    ({"stop_token_ids": [9], "min_tokens": 2}, [9, 5, 9], [9, 5, 9], "stop"),
    ({"max_tokens": 2}, [5, 6, 7], [5, 6], "length"),
    ({"max_tokens": 2}, [5, 2], [5, 2], "length"),  # length is checked first, as in vLLM
    ({"max_tokens": None}, [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10], "length"),  # max_model_len
])
def test_stop_conditions(params, tokens, expected_output, expected_reason):
    scheduler = make_scheduler(max_model_len=10)
    request = make_request("a", 4, eos_token_ids=[2], **params)
    scheduler.add_request(request)
    for token_id in tokens:
        _, finished = step(scheduler, token_id)
        if finished:
            break
    assert finished == [request]
    assert request.output_token_ids == expected_output
    assert request.status.finish_reason == expected_reason
    assert scheduler.block_manager.num_free_blocks == 63


def test_stop_token_is_recorded_as_stop_reason():
    scheduler = make_scheduler()
    request = make_request("a", 2, stop_token_ids=[9])
    scheduler.add_request(request)
    step(scheduler, token_id=9)
    assert request.stop_reason == 9


def test_timestamps_come_from_the_clock():
    ticks = iter(range(100))
    scheduler = make_scheduler(max_num_batched_tokens=4, clock=lambda: next(ticks))
    request = make_request("a", 6, max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)  # chunk of 4: scheduled, nothing sampled
    step(scheduler)  # last 2 prompt tokens: first token
    step(scheduler)  # second token: finished
    assert (request.first_scheduled_time, request.first_token_time, request.finished_time) == (0, 1, 2)


@pytest.mark.parametrize("kwargs, message", [
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16, "max_model_len": 64},
     "raise max_num_batched_tokens to 64"),
    ({"num_blocks": 8, "block_size": 4, "max_model_len": 64},
     "needs 16 blocks of 4 tokens; the pool has 7"),
    ({"max_num_seqs": 0}, "max_num_seqs is 0"),
    ({"long_prefill_token_threshold": 4, "enable_chunked_prefill": False,
      "max_num_batched_tokens": 64}, "chunked prefill is off"),
])
def test_bad_configuration_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_scheduler(**kwargs)


def test_bad_requests_are_refused():
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="'a' is already in use"):
        scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="has 9 tokens; it needs 1 to max_model_len=8"):
        scheduler.add_request(make_request("b", 9))
    with pytest.raises(ValueError, match="has 0 tokens"):
        scheduler.add_request(make_request("c", 0))


# ---- property tests against a fake model ------------------------------------------------

VOCAB_SIZE = 32
EOS_TOKEN_ID = 0


class FakeModel:
    """Writes each scheduled token into a simulated KV pool through the request's block_ids,
    then samples from the context it reads back: a wrong block table changes the output."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.kv_pool: dict[tuple[int, int], tuple[str, int, int]] = {}  # (block, slot) -> entry

    def slot(self, request: Request, position: int) -> tuple[int, int]:
        return request.block_ids[position // self.block_size], position % self.block_size

    def execute(self, output: SchedulerOutput) -> list[int]:
        """The token each request that samples samples, in the step's order."""
        for item in output.scheduled:
            request = item.request
            assert item.start + item.num_new_tokens == request.num_computed_tokens  # counted when scheduled
            for position in range(item.start, item.start + item.num_new_tokens):
                entry = (request.request_id, position, request.all_token_ids[position])
                self.kv_pool[self.slot(request, position)] = entry
        sampled = []
        for item in output.scheduled:
            if item.samples:
                request = item.request
                context = [self.kv_pool[self.slot(request, p)] for p in range(request.num_tokens)]
                assert context == [(request.request_id, p, t)
                                   for p, t in enumerate(request.all_token_ids)]
                key = repr((request.request_id, request.all_token_ids)).encode()
                sampled.append(zlib.crc32(key) % VOCAB_SIZE)
        return sampled


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt_token_ids: list[int]
    params: Params
    abort_step: int | None
    priority: int = 0


@st.composite
def configs(draw) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 24))
    chunked = draw(st.booleans())
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        # tiny pools: one max_model_len request plus at most a few blocks, so preemption is common
        num_blocks=1 + -(-max_model_len // block_size) + draw(st.integers(0, 5)),
        max_num_seqs=draw(st.integers(1, 6)),
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=draw(st.integers(1 if chunked else max_model_len, max_model_len + 8)),
        long_prefill_token_threshold=draw(st.integers(0, 6)) if chunked else 0,
        max_num_prefills=draw(st.none() | st.integers(1, 3)),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


@st.composite
def arrivals(draw, max_model_len: int, with_priority: bool) -> list[Arrival]:
    result = []
    for index in range(draw(st.integers(1, 10))):
        num_prompt_tokens = draw(st.integers(1, max_model_len - 1))
        max_tokens = draw(st.none() | st.integers(1, max_model_len - num_prompt_tokens))
        params = Params(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens or 3)),
            stop_token_ids=draw(st.lists(st.integers(1, VOCAB_SIZE - 1), max_size=2)),
            ignore_eos=draw(st.booleans()),
        )
        prompt = draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=num_prompt_tokens,
                               max_size=num_prompt_tokens))
        result.append(Arrival(draw(st.integers(0, 8)), f"r{index}", prompt, params,
                              draw(st.none() | st.integers(0, 30)), draw(st.integers(0, 2)) if with_priority else 0))
    return result


def new_request(arrival: Arrival) -> Request:
    return Request(arrival.request_id, arrival.prompt_token_ids, arrival.params, [EOS_TOKEN_ID],
                   priority=arrival.priority)


def check_after_schedule(scheduler: Scheduler, output: SchedulerOutput) -> None:
    manager = scheduler.block_manager
    manager.check_invariants(scheduler.requests.values())
    assert scheduler.num_running <= scheduler.max_num_seqs
    assert output.num_scheduled_tokens <= scheduler.max_num_batched_tokens
    num_prefills = sum(item.num_new_tokens > 1 for item in output.scheduled)
    assert scheduler.max_num_prefills is None or num_prefills <= scheduler.max_num_prefills
    request_ids = [item.request.request_id for item in output.scheduled]
    assert len(set(request_ids)) == len(request_ids)
    if isinstance(scheduler.waiting, PriorityQueue):  # the running list is in preemption order: the last goes first
        keys = [priority_key(request) for request in scheduler.running]
        assert keys == sorted(keys)
    for item in output.scheduled:
        assert item.num_new_tokens >= 1
        end = item.start + item.num_new_tokens
        assert len(item.request.block_ids) == manager.blocks_needed(end)
        if not scheduler.enable_chunked_prefill:
            assert end == item.request.num_tokens, "without chunking a prompt runs whole"
    assert output.scheduled or output.preempted_request_ids or not scheduler.has_unfinished_requests()


def check_after_update(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    manager.check_invariants(scheduler.requests.values())
    for request in scheduler.requests.values():
        assert len(request.block_ids) == manager.blocks_needed(request.num_computed_tokens)
        assert request.num_computed_tokens < request.num_tokens
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0


def serve(config: dict, workload: list[Arrival], check: bool) -> dict[str, Request]:
    """Drive a scheduler and the fake model until every request of `workload` finished."""
    scheduler = make_scheduler(**config)
    model = FakeModel(config["block_size"])
    requests: dict[str, Request] = {}
    step_index = 0
    while step_index <= max(a.step for a in workload) or scheduler.has_unfinished_requests():
        assert step_index < 2000, "the scheduler made no progress"
        for arrival in workload:
            if arrival.step == step_index:
                requests[arrival.request_id] = new_request(arrival)
                scheduler.add_request(requests[arrival.request_id])
            if arrival.abort_step == step_index and check:
                aborted = scheduler.abort_request(arrival.request_id)
                assert aborted is None or aborted.status == RequestStatus.FINISHED_ABORTED
        output = scheduler.schedule()
        if check:
            check_after_schedule(scheduler, output)
        scheduler.update(output, model.execute(output))
        if check:
            check_after_update(scheduler)
        step_index += 1
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_usable_blocks
    assert scheduler.num_running == scheduler.num_waiting == 0
    return requests


def run_alone(config: dict, arrival: Arrival) -> Request:
    alone = Arrival(0, arrival.request_id, arrival.prompt_token_ids, arrival.params, None, arrival.priority)
    return serve(config, [alone], check=False)[arrival.request_id]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_request_gets_exactly_the_tokens_it_would_get_alone(data):
    config = data.draw(configs())
    workload = data.draw(arrivals(config["max_model_len"], config["scheduling_policy"] == "priority"))
    requests = serve(config, workload, check=True)
    for arrival in workload:
        request, reference = requests[arrival.request_id], run_alone(config, arrival)
        assert reference.num_preemptions == 0
        assert request.is_finished
        if request.status == RequestStatus.FINISHED_ABORTED:
            num_output = request.num_output_tokens
            assert request.output_token_ids == reference.output_token_ids[:num_output]
        else:
            assert request.output_token_ids == reference.output_token_ids
            assert request.status == reference.status
