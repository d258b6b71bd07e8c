"""The thread core client: one thread that owns an LLMEngine (and so its EngineCore) and steps it
while there is work; process_client.py is the same interface with the core in another process.

Callers never touch the engine. They put commands (add, abort, shutdown) on a thread-safe
queue; the core applies them between steps and hands every request's outputs to that request's
sink (a callable the caller chose, e.g. one that puts onto an asyncio queue). That is what makes
an abort from any thread safe: it lands between two steps, never inside one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from cbjax.engine.exceptions import EngineDeadError
from cbjax.engine.iteration_stats import IterationStats, IterationStatsCollector
from cbjax.engine.llm_engine import LLMEngine, Prompt
from cbjax.lora.request import LoRARequest
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput | BaseException], None]


class LoopQueueSink:
    """A sink that puts each item on an asyncio queue in the queue's event loop (AsyncLLM's).

    Called alone it schedules one put; `deliver_all` instead hands all of a step's items for one
    loop over in a single call_soon_threadsafe (one wake-up of the loop per step, not per output).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def __call__(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def deliver_all(deliveries: Sequence[tuple[OutputSink, RequestOutput | BaseException]]) -> None:
    """Hand each item to its sink: those bound for one event loop in one call there."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
    for sink, item in deliveries:
        if isinstance(sink, LoopQueueSink):
            by_loop.setdefault(sink.loop, []).append((sink.queue, item))
        else:
            deliver(sink, item)
    for loop, items in by_loop.items():
        deliver(functools.partial(loop.call_soon_threadsafe, _put_all), items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


def deliver(sink: Callable[[Any], None], item: Any) -> None:
    try:
        sink(item)
    except Exception:  # a caller that went away (e.g. its event loop closed) must not stop the engine
        logger.debug("dropped an output: its receiver is gone", exc_info=True)


class StatLogger(Protocol):
    def record_step(self, iteration: IterationStats) -> None:
        """Called after every engine step (in the thread that reads the core's steps) with what it did."""


class ThreadCoreClient:
    def __init__(self, engine: LLMEngine, stat_loggers: Sequence[StatLogger] = ()):
        self.engine = engine
        self.stat_loggers = list(stat_loggers)
        self.commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.sinks: dict[str, OutputSink] = {}
        self.stats: dict[str, Any] = engine.get_stats()  # replaced (not mutated) after every iteration
        if self.stat_loggers:  # they count every request's tokens from the rows, FINAL_ONLY ones too
            engine.book.iteration_stats = IterationStatsCollector(engine.book.parents)
        self.error: BaseException | None = None
        # Commands are queued only while the loop still takes them (a put after its last look would
        # wait forever): `closed` says why not, set under the lock before the loop drains the queue.
        self._lock = threading.Lock()
        self.closed: EngineDeadError | None = None
        self.thread = threading.Thread(target=self._run, name="cbjax-engine-core", daemon=True)

    # ---- called from any thread -------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, sink: OutputSink, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; its outputs, or the ValueError that rejected it, go to `sink`. It arrives
        now, not when the core dequeues it, so its TTFT counts the wait for the running step (as vLLM's)."""
        if not self._put(("add", request_id, prompt, params, sink, time.monotonic(), priority, lora_request)):
            deliver(sink, self.closed)

    def call(self, function: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """`function(engine_core, *args)` on the core thread, between two steps (as ProcessCoreClient.call)."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        if not self._put(("call", function, args, result)):
            raise self.closed
        return result.result(timeout)

    def abort_request(self, request_id: str) -> None:
        self._put(("abort", request_id))

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what is left, deliver its outputs, stop the thread."""
        if self._put(("shutdown",)) and self.thread.is_alive():
            self.thread.join(timeout)

    def _put(self, command: tuple) -> bool:
        """Queue a command; False once the loop has ended (nobody would apply it)."""
        with self._lock:
            if self.closed is not None:
                return False
            self.commands.put(command)
            return True

    @property
    def is_alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    # ---- the core thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                self._step()
            while self.engine.has_unfinished_requests():  # shutting down: flush the aborts' outputs
                self._step()
            closed = EngineDeadError("the engine core was shut down")
        except BaseException as error:  # the loop is dead: say why, and fail everyone waiting
            logger.exception("the engine-core loop died")
            self.error = error
            closed = EngineDeadError(f"the engine-core loop died: {error!r}")
        with self._lock:  # from here on an add fails at once
            self.closed = closed
        for sink in self.sinks.values():
            deliver(sink, closed)
        self.sinks.clear()
        while (command := self._next_command()) is not None:  # adds sent while it was ending
            if command[0] == "add":
                deliver(command[4], closed)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle); False once shutdown was asked."""
        command = self.commands.get() if block else self._next_command()
        while command is not None:
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "abort":
                self.engine.abort_request(command[1])
            elif command[0] == "call":
                _, function, args, result = command
                try:
                    result.set_result(function(self.engine.core, *args))
                except Exception as error:  # the caller's function failed, not the engine
                    result.set_exception(error)
            else:
                for request_id in self.sinks:
                    self.engine.abort_request(request_id)
                return False
            command = self._next_command()
        return True

    def _next_command(self) -> tuple | None:
        try:
            return self.commands.get_nowait()
        except queue.Empty:
            return None

    def _add(
        self, request_id: str, prompt: Prompt, params: SamplingParams, sink: OutputSink, arrival_time: float,
        priority: int, lora_request: LoRARequest | None,
    ) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time, priority, lora_request)
        except (ValueError, TypeError) as error:  # bad input: the caller hears why, the others carry on
            deliver(sink, error)
            return
        self.sinks[request_id] = sink

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        self.stats = self.engine.get_stats()  # before delivery: a finished caller sees its blocks freed
        deliveries = []
        for output in outputs:
            sink = self.sinks.pop(output.request_id, None) if output.finished else self.sinks.get(output.request_id)
            if sink is not None:
                deliveries.append((sink, output))
        for request_id, error in self.engine.take_failed():  # requests the core could not prepare
            if (sink := self.sinks.pop(request_id, None)) is not None:
                deliveries.append((sink, error))
        deliver_all(deliveries)
        if self.stat_loggers:
            iteration_stats = self.engine.book.iteration_stats
            iteration = iteration_stats.end_step(self.stats, self.engine.last_step_num_tokens, now, now)
            iteration.finished_requests = iteration_stats.finished(outputs, now)
            for stat_logger in self.stat_loggers:
                stat_logger.record_step(iteration)

