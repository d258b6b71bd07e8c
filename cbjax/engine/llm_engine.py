"""LLMEngine: add_request / abort_request / step, the loop every in-process front end drives.

It is the front end of one EngineCore in this process: it tokenizes and checks prompts, makes
each request's children (parallel_sampling.py), and turns each core step into RequestOutputs
through its request book, with the same Request objects the core schedules.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from cbjax.config import EngineConfig
from cbjax.core.engine_core import EngineCore
from cbjax.core.outputs import EngineCoreStep
from cbjax.core.request import Request
from cbjax.engine.output_processor import OutputProcessor
from cbjax.engine.parallel_sampling import ParentRequest
from cbjax.engine.request_book import Prompt, RequestBook, eos_token_ids, tokenize_request
from cbjax.lora.request import LoRARequest, check_lora_request
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer


class LLMEngine:
    """One model, one KV pool, one scheduler; `step()` advances every running request by one step."""

    def __init__(self, config: EngineConfig, *, precompile: bool = True, progress: bool = True):
        from cbjax.worker.build import build_worker  # the device side: importing this module imports no JAX

        self.config = config
        worker = build_worker(config, precompile=precompile, progress=progress)
        self.model_config = worker.model_config
        self.core = EngineCore(config, worker.runner, worker.model_config, worker.platform, worker.drafter)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.book = RequestBook(self.output_processor)
        # Abort ids may arrive from any thread; deque appends and pops are atomic, and step() applies
        # them between device steps, so an abort never lands inside a step.
        self.pending_aborts: collections.deque[str] = collections.deque()
        self.failed: list[tuple[str, ValueError]] = []  # requests the core could not prepare (take_failed)

    # The core's parts, for benchmarks and tests that look inside.
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    block_manager = property(lambda self: self.core.block_manager)
    in_flight = property(lambda self: self.core.in_flight)
    last_step_num_tokens = property(lambda self: self.core.last_step_num_tokens)

    @property
    def backend(self) -> str:
        """The attention backend the steps run with (the runner's: it falls back to "xla" if the C++ kernel's build fails)."""
        return self.core.runner.backend

    # ---- requests -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (n > 1: one child request per completion); bad input raises ValueError
        and leaves the engine as it was. `priority` orders it under the priority scheduling policy
        (lower first); `lora_request` runs it under that LoRA adapter (enable_lora)."""
        params = sampling_params or SamplingParams()
        self.book.check_free(request_id, params.n)
        text, token_ids = tokenize_request(self.tokenizer, prompt, params)
        self.core.check_request(token_ids, params, self.eos_token_ids, priority, check_lora_request(lora_request))
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        parent = self.book.add_new(request_id, token_ids, params, self.eos_token_ids, arrival_time, text, priority,
                                   lora_request)
        self.core.add_requests(parent.children)

    def abort_request(self, request_id: str) -> None:
        """Stop a request, or one child of an n > 1 request by its child id (safe from any thread);
        its output so far comes back from the next step() with reason "abort". Unknown or finished
        ids are ignored."""
        self.pending_aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self.pending_aborts)

    # ---- the loop -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One core step (EngineCore.step: schedule, launch, read a step's tokens): the outputs of
        the requests that progressed, and of those aborted since the last step."""
        aborted = self._apply_aborts()
        step = self.core.step()
        if self.core.failed:
            self._fail_requests()
        outputs = [self.book.finish(parent) for parent in aborted] if aborted else []
        if step.sampled is not None:
            outputs += self._record(step)
        return outputs

    def _apply_aborts(self) -> list[ParentRequest]:
        """Abort the requests (or single children) named since the last step: the parents this
        finished, each once however often it was named (a parent whose other children still run
        gives its final output when they finish)."""
        finished: dict[str, ParentRequest] = {}
        while self.pending_aborts:
            for child in self.book.children_of(self.pending_aborts.popleft()):
                self.core.abort_request(child.request_id)
                parent = self.book.parents[child.request_id]
                if parent.finished:
                    finished[parent.request_id] = parent
        return list(finished.values())

    def _fail_requests(self) -> None:
        """Requests one of whose completions the core could not prepare: their other completions are
        aborted, and each fails with a ValueError that take_failed gives its caller; no output."""
        for child, why in self.core.take_failed():
            parent = self.book.parents.get(child.request_id)
            if parent is None:  # (a sibling failed first)
                continue
            for sibling in parent.children:
                self.core.abort_request(sibling.request_id)
            self.book.finish(parent)  # (its output is dropped: the caller gets the ValueError)
            self.failed.append((parent.request_id, ValueError(why)))

    def take_failed(self) -> list[tuple[str, ValueError]]:
        """(request id, error) of the requests failed since the last call (see _fail_requests)."""
        failed, self.failed = self.failed, []
        return failed

    def _record(self, step: EngineCoreStep) -> list[RequestOutput]:
        """A core step's outputs (RequestBook.progressed says which requests have one)."""
        for request_id, chunk in step.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(request_id, chunk)
        progressed = self.book.progressed(step.sampled, step.finished, self._stop)
        return self.book.outputs(progressed)

    def _stop(self, request: Request) -> None:
        self.core.stop_request(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (and nothing done) while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        return self.core.get_stats()
