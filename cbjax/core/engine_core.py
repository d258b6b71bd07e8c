"""EngineCore (vLLM V1's name): schedule -> execute -> update, over a model runner built outside.

It owns the scheduler, the block manager and the runner, and knows requests only as the
scheduler does (child requests, by their own ids). Its front ends make text and outputs:
LLMEngine in this process reads each step's EngineCoreStep through its request book; the
engine-core process (engine_core_proc.py) sends it to its front end as StepProgress. It is not
thread-safe: its front end calls it from one thread, and lands aborts between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from cbjax.config import EngineConfig
from cbjax.core.kv.block_manager import BlockManager
from cbjax.core.kv.prefix_cache import computes_whole_prompt
from cbjax.core.outputs import NOTHING_READ, EngineCoreStep, PromptLogprobsChunk, SampledTokens
from cbjax.core.request import Request, RequestStatus
from cbjax.core.request_checks import RequestLimits, check_request
from cbjax.core.sched.output import SchedulerOutput
from cbjax.core.sched.scheduler import Scheduler
from cbjax.core.spec.speculation import Drafter, Speculation
from cbjax.core.structured.manager import StructuredOutputManager


class StepRunner(Protocol):
    """What the core asks of the device side (worker/model_runner.py's ModelRunner)."""

    num_blocks: int
    backend: str
    buckets: list[Any]
    max_suppressed_ids: int

    def dispatch(self, scheduled: SchedulerOutput) -> Any:
        """Launch a step without waiting for it: a handle for `collect`."""

    def collect(self, launched: Any) -> tuple[SampledTokens, dict[str, PromptLogprobsChunk]]:
        """Wait for a launched step: its sampled tokens and the prompt logprobs it scored."""

    def release_request(self, request_id: str) -> None:
        """Free what the runner holds for a finished or aborted request."""

    def add_lora(self, lora_request: Any) -> None:
        """Read and check a LoRA adapter onto the host (ValueError if bad, or LoRA is off)."""

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter; False if none has that id."""

    # (request id, why) of requests whose rows `dispatch` could not write: the core finishes them.
    failed_requests: list[tuple[str, str]]


class EngineCore:
    def __init__(self, config: EngineConfig, runner: StepRunner, model_config: Any, platform: str,
                 drafter: Drafter | None = None):
        self.config = config
        # Speculative decoding (speculative_config): the drafts, proposed after each step, and their counters.
        spec = config.speculative_config
        self.speculation = None if spec is None else Speculation(spec, drafter)
        self.runner = runner
        self.model_config = model_config
        self.platform = platform
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
                                          hash_algo=config.prefix_caching_hash_algo)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            block_manager=self.block_manager,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_num_prefills=config.max_num_prefills,
            scheduling_policy=config.scheduling_policy,
            max_spec_batch_size=0 if spec is None else spec.disable_by_batch_size,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        # What each request is checked against; a front end in another process gets them too.
        self.limits = RequestLimits(config.max_model_len, model_config.vocab_size, config.max_logprobs,
                                    runner.max_suppressed_ids, config.scheduling_policy)
        # Constrained requests' grammars: they wait there while theirs compile, then join the scheduler.
        self.structured = StructuredOutputManager(config.tokenizer or config.model, model_config.vocab_size,
                                                   config.reasoning_parser)
        self.failed: list[tuple[Request, str]] = []  # requests the runner could not prepare (take_failed)
        self.num_steps = 0
        self.in_flight: Any = None  # async scheduling: a launched step whose tokens are not read yet
        self.last_step_num_tokens = 0  # tokens of the step the latest step() launched (prompt chunks + decodes)

    # ---- requests -------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: Any, eos_token_ids: list[int], priority: int,
                      lora_request: Any = None) -> None:
        """Raise ValueError, saying what to change, for a request this engine cannot serve (its LoRA
        adapter, if any, is read onto the host here, so a bad one fails now)."""
        check_request(self.limits, prompt_token_ids, params, eos_token_ids, priority)
        if lora_request is not None:
            self.runner.add_lora(lora_request)
        if params.structured_outputs is not None and self.config.num_processes > 1:
            # The workers launch each step from its packed inputs alone; the masks do not travel to them yet.
            raise ValueError(f"structured outputs are not supported with num_processes={self.config.num_processes} "
                             "(multi-host); serve constrained requests from a single-process engine")

    def add_requests(self, completions: Sequence[Request]) -> None:
        """Queue the completions of one prompt (n > 1: several; see parallel_sampling.py), checked
        already (check_request). With prefix caching the others wait for the first's prompt blocks.
        A constrained prompt's completions are queued once their grammars compile (take_compiled)."""
        if completions[0].sampling_params.structured_outputs is not None:
            self.structured.submit(completions)
            return
        self._queue(completions)

    def _queue(self, completions: Sequence[Request]) -> None:
        first = completions[0]
        wait_for = first if self._shares_prompt(completions) else None
        for request in completions:
            self.scheduler.add_request(request, wait_for if request is not first else None)

    def _shares_prompt(self, completions: Sequence[Request]) -> bool:
        """True when completions 1..n-1 find the first's prompt blocks cached instead of computing their own."""
        return (len(completions) > 1 and self.config.enable_prefix_caching
                and not computes_whole_prompt(completions[0].sampling_params))

    def add_lora(self, lora_request: Any) -> None:
        """Read and check a LoRA adapter onto the host now (vLLM's add_lora); ValueError if it is bad."""
        self.runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter (requests running under it finish under it); False if none has that id."""
        return self.runner.remove_lora(lora_int_id)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish an unfinished request as aborted and free what it holds; None if unknown or finished."""
        return self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def stop_request(self, request_id: str) -> Request | None:
        """Finish an unfinished request a stop string ended (its front end found it); as an abort, a
        step in flight skips its row."""
        return self._finish(request_id, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request_id: str, status: RequestStatus) -> Request | None:
        request = self.scheduler.finish_request(request_id, status)
        if request is not None:
            self._release(request)
            return request
        request = self.structured.withdraw(request_id)  # its grammar still compiling: never scheduled
        if request is not None:
            request.status, request.finished_time = status, self.scheduler.clock()
        return request

    def _fail_requests(self) -> None:
        """Finish, and free, each request the runner could not prepare (a value its rows cannot
        hold): a step in flight skips its row, as an abort's; take_failed gives them to the front end."""
        failed = self.runner.failed_requests
        while failed:
            request_id, why = failed.pop(0)
            request = self._finish(request_id, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                self.failed.append((request, why))

    def take_failed(self) -> list[tuple[Request, str]]:
        """The requests failed since the last call, each with why: its caller's ValueError."""
        failed, self.failed = self.failed, []
        return failed

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.in_flight is not None
                or self.structured.is_compiling())

    def _queue_compiled(self) -> None:
        """Queue the constrained requests whose grammars are ready; fail those whose compile failed.
        With nothing else to run, wait a little for one instead of spinning."""
        if not self.scheduler.has_unfinished_requests() and self.in_flight is None:
            self.structured.wait(timeout=0.05)
        ready, failed = self.structured.take_compiled()
        for completions in ready:
            self._queue(completions)
        for request, why in failed:
            request.status, request.finished_time = RequestStatus.FINISHED_ABORTED, self.scheduler.clock()
            self.failed.append((request, why))

    # ---- the loop -------------------------------------------------------------

    def step(self) -> EngineCoreStep:
        """Schedule and launch a device step, and read a step's tokens into their requests.

        The step read is the one just launched, or with async scheduling the one launched before
        it, read while the new one runs (which takes its decode tokens from that step's output on
        the device): the host's work overlaps the device's.
        """
        if self.in_flight is not None and not self._overlaps():
            # Overlapping stops: read the step in flight now and schedule the next one on the next
            # call, so each call still reports one step (an abort between calls lands exactly).
            launched, self.in_flight = self.in_flight, None
            self.last_step_num_tokens = 0  # it launched none
            return self._update(launched)
        if self.structured.is_compiling():
            self._queue_compiled()
        scheduled = self.scheduler.schedule()
        self.last_step_num_tokens = scheduled.num_scheduled_tokens
        launched = self.runner.dispatch(scheduled) if scheduled.scheduled else None
        self.num_steps += launched is not None
        if self.runner.failed_requests:  # rows it could not write: their requests fail, the step goes on
            self._fail_requests()
        # A step in flight is always read before this one; a step that verifies drafts is read before the next
        # is scheduled (its requests' token counts are known only then).
        if self.in_flight is not None or (not scheduled.spec_token_ids and self._overlaps()):
            launched, self.in_flight = self.in_flight, launched
        return NOTHING_READ if launched is None else self._update(launched)

    def _update(self, launched: Any) -> EngineCoreStep:
        """Read a launched step's tokens into its requests; a request finished since it was launched
        is skipped (its blocks and slot are free already), and a request it finishes is freed."""
        sampled, prompt_logprobs = self.runner.collect(launched)
        scheduled = launched.scheduled
        if prompt_logprobs:
            prompt_logprobs = {row.request.request_id: prompt_logprobs[row.request.request_id]
                               for row in scheduled.scheduled
                               if not row.request.is_finished and row.request.request_id in prompt_logprobs}
        skipped: list[Request] = []
        runs = self._verified_runs(scheduled, sampled) if sampled.runs else None
        finished = self.scheduler.update(scheduled, sampled.token_ids, skipped, runs)
        if self.structured.has_constrained():
            for request in self.structured.advance():  # its grammar is complete: it stops, as at eos
                finished.append(self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED))
        for request in finished:  # now: its slot serves others from the next step
            self._release(request)
        speculation = self.speculation
        if speculation is not None and speculation.is_on(len(self.scheduler.running)):
            speculation.propose(row.request for row in scheduled.scheduled if row.samples)
        return EngineCoreStep(sampled, prompt_logprobs, finished, skipped, scheduled.preempted_request_ids)

    def _verified_runs(self, scheduled: SchedulerOutput, sampled: SampledTokens) -> dict[str, list[int]]:
        """The verifying rows' runs by request id, each verification counted."""
        by_request = {sampled.sampling_requests[row].request_id: run for row, run in sampled.runs.items()}
        for request_id, drafts in scheduled.spec_token_ids.items():
            self.speculation.record(request_id, len(drafts), len(by_request[request_id]) - 1)
        return by_request

    def _release(self, request: Request) -> None:
        """Free what the runner and the proposer hold for a finished request."""
        self.runner.release_request(request.request_id)
        if self.speculation is not None:
            self.speculation.finish(request)

    def _overlaps(self) -> bool:
        """Whether this step reads the previous step's tokens (async scheduling) or its own.

        async_scheduling=None ("auto", `cbjax serve`'s default): always on an accelerator. On a CPU
        only while every seat is taken: there the step runs on the host's own cores, and a prompt
        that arrives while one step runs, with a seat free, would wait for the step already
        launched behind it too (one more decode step of time to first token); with no seat free
        it waits for a seat anyway, and overlapping keeps a full server's throughput.
        """
        mode = self.config.async_scheduling
        if self.structured.has_constrained():  # a constrained row's mask needs the token in flight: none overlaps
            return False
        if self.speculation is not None and self.speculation.is_on(len(self.scheduler.running)):
            return False  # drafts follow a request's newest token: none may be in flight
        if mode is None:
            return self.platform != "cpu" or len(self.scheduler.running) >= self.config.max_num_seqs
        return mode

    # ---- state ----------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (and nothing done) while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        block_manager = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_total": block_manager.num_blocks - 1,
            "kv_blocks_free": block_manager.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "prefix_cache_queries": block_manager.prefix_cache_queries,
            "prefix_cache_hits": block_manager.prefix_cache_hits,
            "prefix_cache_hit_rate": block_manager.prefix_cache_hits / max(1, block_manager.prefix_cache_queries),
            "attention_backend": self.runner.backend,
            "buckets": len(self.runner.buckets),
            **({} if self.speculation is None else self.speculation.stats()),
        }
