"""Continuous batching: which requests compute how many tokens each step (vLLM V1's scheduler).

There is no separate prefill phase. Each step has a budget of max_num_batched_tokens:
running requests go first, in the policy's order (one token for a decode, the next chunk
of a partly computed prompt), then waiting requests are admitted in the policy's order
while there are seats, budget and blocks; nobody overtakes the head of the queue. At most
max_num_prefills requests compute more than one token in a step (the jnp attention sizes
its query tiles by it); a prompt chunk beyond that waits for the next step. A running
request that cannot get a block preempts, by recompute, the running request the policy
gives up first (possibly itself), and nobody new is admitted in that step. The policy
(policy.py: "fcfs" or "priority") decides both orders.

Progress is counted when a step is scheduled (vLLM V1's way): a request's num_computed_tokens
covers the tokens of launched steps, and a token such a step will sample is a placeholder
(`num_output_placeholders`) until `update` reads it. So the next step can be scheduled while
one runs (async scheduling): a request whose sampled token is still a placeholder decodes it,
the runner taking its value on the device.

A waiting request starts after the longest chain of its blocks found in the prefix cache
(the block manager's answer); it needs blocks only for the rest. A request can be held
until another request has computed its prompt (the completions of one prompt, n > 1), so
that it finds that prompt's blocks cached instead of computing them again.
"""

import logging
import time
from collections.abc import Callable, Sequence

from cbjax.core.kv.block_manager import BlockManager
from cbjax.core.request import Request, RequestStatus
from cbjax.core.sched.output import ScheduledRequest, SchedulerOutput, scheduled_request
from cbjax.core.sched.policy import RequestQueue, make_request_queue
from cbjax.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING  # an enum member looked up on its class costs ~70 ns: once here, not per row


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_manager: BlockManager,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        max_num_prefills: int | None = None,
        scheduling_policy: str = "fcfs",
        clock: Callable[[], float] = time.monotonic,
        max_spec_batch_size: int = 0,
        max_loras: int | None = None,
    ):
        for name, value in [
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ]:
            if value < 1:
                raise ValueError(f"{name} is {value}; it must be at least 1")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens is {max_num_batched_tokens}, below max_model_len "
                f"{max_model_len}, and chunked prefill is off, so a long prompt could never "
                f"be scheduled; raise max_num_batched_tokens to {max_model_len} or set "
                "enable_chunked_prefill=True"
            )
        if max_num_prefills is not None and max_num_prefills < 1:
            raise ValueError(f"max_num_prefills is {max_num_prefills}; it must be at least 1 or None (no limit)")
        if long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold is {long_prefill_token_threshold}; "
                "it must be 0 (off) or positive"
            )
        if long_prefill_token_threshold and not enable_chunked_prefill:
            raise ValueError(
                f"long_prefill_token_threshold is {long_prefill_token_threshold}, which splits "
                "prompts into chunks, but chunked prefill is off; set it to 0 or set "
                "enable_chunked_prefill=True"
            )
        blocks_per_request = block_manager.blocks_needed(max_model_len)
        if blocks_per_request > block_manager.num_usable_blocks:
            raise ValueError(
                f"one request of max_model_len {max_model_len} needs {blocks_per_request} "
                f"blocks of {block_manager.block_size} tokens; the pool has "
                f"{block_manager.num_usable_blocks}; give the KV cache more blocks or "
                "lower max_model_len"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_prefills = max_num_prefills
        self.clock = clock
        # Running requests' drafts are verified only in a step that starts with at most this many
        # running (speculative_config's disable_by_batch_size; 0: never).
        self.max_spec_batch_size = max_spec_batch_size
        self.max_loras = max_loras  # LoRA adapters the running requests may use at once (None: no LoRA)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: RequestQueue = make_request_queue(scheduling_policy)
        self.held: dict[Request, Request] = {}  # request -> the request whose prompt it waits for
        self.running: list[Request] = []  # in the policy's preemption order: the last is preempted first
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request, wait_for: Request | None = None) -> None:
        """Queue `request`; with `wait_for`, only once that request's prompt is computed (or it finished)."""
        if request.request_id in self.requests:
            raise ValueError(
                f"request id {request.request_id!r} is already in use; give each request a unique id"
            )
        if not 1 <= request.num_tokens <= self.max_model_len:
            raise ValueError(
                f"request {request.request_id} has {request.num_tokens} tokens; it needs "
                f"1 to max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        self.check_priority(request.priority)
        params = request.sampling_params
        request.max_num_tokens = self.max_model_len
        if params.max_tokens is not None:
            request.max_num_tokens = min(self.max_model_len, request.num_prompt_tokens + params.max_tokens)
        request.stop_check_ids = frozenset(params.stop_token_ids or ()) | frozenset(() if params.ignore_eos else request.eos_token_ids)
        self.requests[request.request_id] = request
        if wait_for is None:
            self.waiting.add(request)
        else:
            self.held[request] = wait_for

    def check_priority(self, priority: int) -> None:
        """ValueError if the scheduling policy takes no `priority` (fcfs: only 0)."""
        self.waiting.check_priority(priority)

    def abort_request(self, request_id: str) -> Request | None:
        """Stop an unfinished request and free its blocks; None if it is unknown or finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish an unfinished request with `status` (e.g. a stop string matched)."""
        if not status.is_finished:
            raise ValueError(f"status {status.name} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.held:
            del self.held[request]
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work; the block_ids of every scheduled request cover its new tokens."""
        self._release_held()
        token_budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        allocated: list[Request] = []

        num_prefills = 0  # scheduled requests computing more than one token
        prefills_left = self.max_num_prefills is None or self.max_num_prefills > 0
        block_manager = self.block_manager
        block_size = block_manager.block_size
        spec_token_ids: dict[str, list[int]] = {}  # the drafts this step verifies, by request id
        speculates = len(self.running) <= self.max_spec_batch_size

        # A for loop over the running list, though preemption pops from its end: a list's iterator
        # stops at the list's current length, and every victim lies after the row being scheduled.
        for request in self.running:
            if token_budget <= 0:
                break
            start, pending = request.num_computed_tokens, request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + pending
            drafts = request.spec_token_ids
            if drafts:  # taken now or never: once the request moves on they no longer follow its tokens
                request.spec_token_ids = []
                num_draft = min(len(drafts), token_budget - 1, request.max_num_tokens - num_tokens - 1)
                if speculates and prefills_left and num_draft > 0 and num_tokens == start + 1 and not pending:
                    drafts = drafts[:num_draft]
                    if not self._schedule_verify(request, drafts, scheduled, allocated, preempted):
                        break  # it preempted itself: nobody after it is left
                    spec_token_ids[request.request_id] = drafts
                    token_budget -= 1 + num_draft
                    num_prefills += 1  # its 1 + k query tokens take a prompt chunk's place in the step
                    prefills_left = self.max_num_prefills is None or num_prefills < self.max_num_prefills
                    continue
            if num_tokens == start + 1 and (not pending or num_tokens < request.max_num_tokens):
                # A decode (what _num_new_tokens, the block check, _allocate and _advance decide for
                # it, without the calls: hundreds a step): with room in its last block, most requests
                # most steps; or starting a block, one in block_size, if the pool has one to give.
                capacity = len(request.block_ids) * block_size
                if start < capacity or (start == capacity and block_manager.append_block(request)):
                    if start == capacity:
                        allocated.append(request)
                    request.num_computed_tokens, request.num_output_placeholders = num_tokens, pending + 1
                    scheduled.append(scheduled_request((request, 1, start, True)))
                    token_budget -= 1
                    continue
            num_new_tokens = self._num_new_tokens(request, token_budget, prefills_left)
            if num_new_tokens == 0:
                continue
            # Most steps most requests decode with room in their last block: nothing to allocate or
            # check (block_manager.num_missing_blocks() > 0, without the call).
            needs_blocks = request.num_computed_tokens + num_new_tokens > len(request.block_ids) * block_size
            while needs_blocks and not block_manager.can_allocate(request, num_new_tokens):
                victim = self.running.pop()  # the policy's first to go; scheduled ones sit before this one
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                if needs_blocks:
                    scheduled.append(self._allocate(request, num_new_tokens))
                    allocated.append(request)
                else:
                    scheduled.append(self._advance(request, num_new_tokens))
                token_budget -= num_new_tokens
                if num_new_tokens > 1:
                    num_prefills += 1
                    prefills_left = self.max_num_prefills is None or num_prefills < self.max_num_prefills
                continue
            break  # it preempted itself: nobody after it is left

        while (
            not preempted
            and self.waiting
            and token_budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.lora_request is not None and not self._lora_fits(request.lora_request):
                break  # its adapter needs a device slot that running requests hold (vLLM's max_loras rule)
            computed_blocks = self.block_manager.get_computed_blocks(request)
            num_cached_tokens = len(computed_blocks) * self.block_manager.block_size
            num_new_tokens = self._num_new_tokens(request, token_budget, prefills_left, num_cached_tokens)
            if num_new_tokens == 0 or not self.block_manager.can_allocate(request, num_new_tokens, computed_blocks):
                break  # the policy's strict order: nobody overtakes the head of the queue
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
                request.num_cached_tokens = num_cached_tokens
            self.waiting.admit(self.running, request)
            scheduled.append(self._allocate(request, num_new_tokens, computed_blocks))
            allocated.append(request)
            token_budget -= num_new_tokens
            if num_new_tokens > 1:
                num_prefills += 1
                prefills_left = self.max_num_prefills is None or num_prefills < self.max_num_prefills

        return SchedulerOutput(scheduled, [request.request_id for request in preempted], allocated,
                               self.max_num_batched_tokens - token_budget, spec_token_ids)

    def _schedule_verify(self, request: Request, drafts: list[int], scheduled: list[ScheduledRequest],
                         allocated: list[Request], preempted: list[Request]) -> bool:
        """Schedule `request`'s newest token and its drafts, with lookahead slots for the drafts (their
        KV is overwritten where rejected); False if it had to preempt itself for the blocks."""
        num_new_tokens = 1 + len(drafts)
        block_manager = self.block_manager
        if request.num_computed_tokens + num_new_tokens > len(request.block_ids) * block_manager.block_size:
            while not block_manager.can_allocate(request, num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return False
            block_manager.allocate(request, num_new_tokens)
            allocated.append(request)
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new_tokens
        request.num_output_placeholders += 1
        scheduled.append(ScheduledRequest(request, num_new_tokens, start, True))
        return True

    def update(self, scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int],
               skipped: list[Request] | None = None, runs: dict[str, list[int]] | None = None) -> list[Request]:
        """Record the step's sampled tokens (one per scheduled request that samples, in their order)
        and cache the blocks it filled; return the requests that finished, in that order. A request
        finished since the step was scheduled (an abort, or a stop found in the step before) is
        skipped: what the step computed for it is discarded (and it is appended to `skipped`, if given).
        A row that verified drafts emitted the tokens of its run in `runs` (by request id): they are
        appended one by one, each checked for a stop as a sampled token is, and the run is cut to those
        appended; the request's computed tokens roll back to those its verified tokens fill."""
        finished = []
        block_manager = self.block_manager
        # Blocks to register in the prefix cache: a running request's computed tokens fill one past
        # those it registered (BlockManager.cache_full_blocks's work), checked inline for every row.
        caching, block_size = block_manager.enable_caching, block_manager.block_size
        rows = scheduler_output.scheduled
        if len(sampled_token_ids) < len(rows):  # (where every row samples, as in most steps, the column is per row)
            sampled = iter(sampled_token_ids)
            sampled_token_ids = [next(sampled) if row.samples else None for row in rows]
        for (request, _, _, samples), token_id in zip(rows, sampled_token_ids):
            status = request.status
            if status is not _RUNNING and status.is_finished:  # (else running, or preempted since it was scheduled)
                if skipped is not None:
                    skipped.append(request)
                continue
            if runs and request.request_id in runs:
                if self._append_run(request, runs[request.request_id]):
                    finished.append(request)
                elif caching and request.num_computed_tokens >= (request.num_registered_blocks + 1) * block_size:
                    block_manager.cache_full_blocks(request)  # the verified tokens' blocks alone
                continue
            if samples:
                request.num_output_placeholders -= 1
                request.output_token_ids.append(token_id)  # Request.append_output_token, inlined: every token
                request.all_token_ids.append(token_id)
                if request.first_token_time is None:
                    request.first_token_time = self.clock()
            # (a request preempted since holds no blocks)
            if caching and status is _RUNNING and (
                request.num_computed_tokens >= (request.num_registered_blocks + 1) * block_size
            ):
                block_manager.cache_full_blocks(request)
            # Most tokens neither reach the length limit nor are a stop id: no stop check to run.
            if samples and (len(request.all_token_ids) >= request.max_num_tokens or token_id in request.stop_check_ids):
                stop_status = self._stop_status(request)
                if stop_status is not None:
                    self.finish_request(request.request_id, stop_status)
                    finished.append(request)
        return finished

    def _append_run(self, request: Request, run: list[int]) -> bool:
        """Append a verified run (accepted drafts, then the token sampled after them) up to the first
        token that stops the request, cutting the run there; whether it finished."""
        request.num_output_placeholders -= 1
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        for count, token_id in enumerate(run, 1):
            request.append_output_token(token_id)
            if len(request.all_token_ids) >= request.max_num_tokens or token_id in request.stop_check_ids:
                stop_status = self._stop_status(request)
                if stop_status is not None:
                    del run[count:]
                    self.finish_request(request.request_id, stop_status)
                    return True
        # KV is written for every token but the newest; the rejected drafts' slots are overwritten later.
        request.num_computed_tokens = len(request.all_token_ids) - 1
        return False

    def _lora_fits(self, lora_request: LoRARequest) -> bool:
        """Whether a request under `lora_request` may run beside the running ones: its adapter is theirs,
        or they use fewer than max_loras adapters (or there is no limit: LoRA off)."""
        if self.max_loras is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora_request.lora_int_id in running or len(running) < self.max_loras

    def _num_new_tokens(
        self, request: Request, token_budget: int, prefills_left: bool, num_cached_tokens: int = 0
    ) -> int:
        """Tokens to compute for `request` this step (after `num_cached_tokens` found cached); 0 if all
        must wait. `token_budget` is at least 1."""
        pending = request.num_output_placeholders
        num_tokens = len(request.all_token_ids) + pending
        if pending and num_tokens >= request.max_num_tokens:
            return 0  # its pending token ends it (by length): a step for it would be thrown away
        num_new_tokens = num_tokens - request.num_computed_tokens - num_cached_tokens
        if num_new_tokens == 1:  # a decode: no limit below applies to it
            return 1
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        if num_new_tokens > token_budget:
            num_new_tokens = token_budget if self.enable_chunked_prefill else 0
        if num_new_tokens > 1 and not prefills_left:
            return 0  # this step already has max_num_prefills prompt chunks
        return num_new_tokens

    def _allocate(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> ScheduledRequest:
        self.block_manager.allocate(request, num_new_tokens, computed_blocks)
        return self._advance(request, num_new_tokens)

    def _advance(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        """Count `num_new_tokens` of `request` as computed by this step (its blocks already hold them)."""
        start = request.num_computed_tokens
        samples = start + num_new_tokens == len(request.all_token_ids) + request.num_output_placeholders
        request.num_computed_tokens += num_new_tokens
        request.num_output_placeholders += samples
        return ScheduledRequest(request, num_new_tokens, start, samples)

    def _release_held(self) -> None:
        """Requeue (fcfs: first in line) the held requests whose awaited prompt is computed (or never will be)."""
        ready = [r for r, source in self.held.items() if source.is_finished or source.num_output_tokens > 0]
        for request in reversed(ready):
            del self.held[request]
            self.waiting.requeue(request)

    def _preempt(self, request: Request) -> None:
        """Free `request`'s blocks and requeue it (fcfs: first in line) to recompute everything."""
        logger.info(
            "preempted request %s: %d tokens to recompute", request.request_id, request.num_tokens
        )
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)

    def _stop_status(self, request: Request) -> RequestStatus | None:
        """vLLM's stop check, run after each sampled token: length first (max_model_len or
        max_tokens reached), then eos and stop ids."""
        if len(request.all_token_ids) >= request.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        last_token_id = request.output_token_ids[-1]
        params = request.sampling_params
        if last_token_id not in request.stop_check_ids or request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and last_token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last_token_id in params.stop_token_ids:
            request.stop_reason = last_token_id
            return RequestStatus.FINISHED_STOPPED
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        del self.requests[request.request_id]
        self.block_manager.free(request)
        request.status = status
        request.finished_time = self.clock()
