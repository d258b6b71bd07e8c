"""The process core client: this process's end of an engine core in its own process.

Why: on an accelerator a decode step takes a few milliseconds, and a stream's text and output
cost microseconds per request per step. In one process those run on the same interpreter (and
GIL) as the scheduler, between device steps; here the core process (core/engine_core_proc.py)
only schedules, launches and reads tokens back, and sends each step's progress
(core/protocol.py) down a pipe, while this process makes text and outputs (frontend.py) and the
server's own work runs beside it.

    core = ProcessCoreClient(build_engine_core, (options,))   # starts the child, waits until it is ready
    core.add_request(request_id, prompt, params, sink)   # sink(output | error), from any thread
    core.abort_request(request_id); core.shutdown()

The same interface as ThreadCoreClient (core_client.py), which steps the engine in a thread of
this process. The child is spawned (JAX is not fork-safe) and is a daemon: it dies with this process. When the
front end falls behind (a stream's consumer is slow, or the device is faster than the front
end), it reads every step waiting in the pipe and gives each request one output for all of
them (a DELTA output holds what is new since its previous one), as vLLM's output collector does.
Each direction of the pipe has a thread of its own on both sides (vLLM's input and output socket
threads): a full pipe stalls that thread only, never the event loop or the front end's lock.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cbjax.core.engine_core_proc import run_engine_core
from cbjax.core.protocol import StepProgress
from cbjax.core.request_checks import check_request
from cbjax.engine.core_client import OutputSink, StatLogger, deliver, deliver_all
from cbjax.engine.exceptions import EngineDeadError
from cbjax.engine.frontend import Frontend
from cbjax.engine.iteration_stats import IterationStatsCollector
from cbjax.engine.request_book import Prompt, eos_token_ids, tokenize_request
from cbjax.lora.request import LoRARequest, check_lora_request
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ProcessCoreClient:
    def __init__(
        self, build: Callable[..., Any], build_args: tuple = (),
        stat_loggers: Sequence[Callable[[Any], StatLogger]] = (), start_timeout: float | None = None,
    ):
        """Start the core: `build(*build_args)` in the child makes its EngineCore (both picklable,
        e.g. module-level functions: core/engine_core_proc.py's build_engine_core). Raises EngineDeadError if it fails to start."""
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=run_engine_core, args=(child_conn, build, build_args),
                                       name="cbjax-engine-core", daemon=True)
        self.process.start()
        child_conn.close()
        if not self.conn.poll(start_timeout):
            self.process.kill()
            raise EngineDeadError(f"the engine-core process did not start within {start_timeout} s")
        try:
            ready = self._recv_or_dead()
        except Exception as error:  # (an exception the child sent that this process cannot unpickle)
            ready = ("dead", f"the engine core failed to start: {error!r}")
        if ready[0] == "failed":  # what building the core raised there (bad options: a ValueError saying which)
            self.process.join(10)
            raise ready[1]
        if ready[0] != "ready":
            self.process.join(10)
            raise EngineDeadError(ready[1])
        _, self.engine_config, self.model_config, self.stats, self.request_limits = ready
        self.tokenizer = Tokenizer.from_dir(self.engine_config.tokenizer or self.engine_config.model)
        self.frontend = Frontend(self.tokenizer, eos_token_ids(self.tokenizer, self.model_config), self._send_stop)
        self.stat_loggers = [make(self.engine_config) for make in stat_loggers]
        if self.stat_loggers:  # they count every request's tokens from the rows, FINAL_ONLY ones too
            self.frontend.book.iteration_stats = IterationStatsCollector(self.frontend.book.parents)
        self.sinks: dict[str, OutputSink] = {}
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # the front end and the sinks: callers' threads and the reader's
        # Sends go through one thread: a caller (the event loop, the reader finding a stop string
        # under the front end's lock) never waits on a full pipe, so the two directions cannot wedge.
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._read, name="cbjax-engine-output", daemon=True)
        self.sender = threading.Thread(target=self._write, name="cbjax-engine-input", daemon=True)

    def _recv_or_dead(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(10)
            return ("dead", f"the engine-core process exited (exit code {self.process.exitcode})")

    # ---- called from any thread -------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self.sender.start()

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, sink: OutputSink, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Send a request; its outputs, or the ValueError that rejected it, go to `sink`."""
        self.add_requests([(request_id, prompt, params, sink, priority, lora_request)])

    def add_requests(
        self, requests: Sequence[tuple[str, Prompt, SamplingParams, OutputSink, int, LoRARequest | None]],
    ) -> None:
        """Send requests (request_id, prompt, params, sink, priority, lora_request) in one message: the
        core adds them all before its next step, as LLMEngine.add_request calls made between two steps
        (the core reads the adapter, and rejects the request if it is bad)."""
        adds = []
        for request_id, prompt, params, sink, priority, lora_request in requests:
            arrival_time = time.monotonic()
            try:
                text, token_ids = tokenize_request(self.tokenizer, prompt, params)
                check_request(self.request_limits, token_ids, params, self.frontend.eos_token_ids, priority)
                with self._lock:
                    if self.error is not None:
                        raise self.error
                    parent = self.frontend.add_request(request_id, token_ids, params, arrival_time, text, priority,
                                                       check_lora_request(lora_request))
                    self.sinks[request_id] = sink
            except (ValueError, TypeError, EngineDeadError) as error:
                deliver(sink, error)
                continue
            adds.append((request_id, parent.children))  # the mirrors, pickled as they are: nothing sampled yet
        if adds:
            self._send(("add", adds))

    def abort_request(self, request_id: str) -> None:
        with self._lock:  # the core knows the children (a request unknown here is finished, or stopping)
            child_ids = self.frontend.child_ids(request_id)
        if child_ids:
            self._send(("abort", child_ids))

    def call(self, function: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """`function(engine_core, *args)` in the core, between two steps (a benchmark's or a test's probe)."""
        if self.error is not None:
            raise self.error
        self._send(("call", function, args))
        result = self._results.get(timeout=timeout)
        if isinstance(result, BaseException):
            raise result
        return result

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what is left, deliver its outputs, stop the child."""
        if self.process.is_alive():
            self._send(("shutdown",))
            self._closed.wait(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        if self.thread.is_alive():
            self.thread.join(timeout)
        self._outbox.put(None)
        if self.sender.is_alive():
            self.sender.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self.process.is_alive()

    def _send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _send_stop(self, child_id: str) -> None:
        self._send(("stop", child_id))

    # ---- the sender thread ------------------------------------------------------

    def _write(self) -> None:
        """Send the queued messages in order, until shutdown's None."""
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the child is gone: the reader says so to everyone waiting
                logger.debug("the engine-core process is gone; dropped %s", message[0])

    # ---- the reader thread ------------------------------------------------------

    def _read(self) -> None:
        try:
            while not self._closed.is_set():
                messages = [self._recv_or_dead()]
                while not _is_dead(messages[-1]) and self.conn.poll():  # behind: one output per request for every step waiting
                    messages.append(self._recv_or_dead())
                steps = []
                for message in messages:
                    if isinstance(message, StepProgress):
                        steps.append(message)
                    elif message[0] == "result":
                        self._results.put(message[1])
                    elif message[0] == "closed":
                        self._closed.set()
                    else:  # "dead"
                        raise EngineDeadError(message[1])
                if steps:
                    self._apply(steps)
        except BaseException as error:
            logger.error("the engine core stopped: %s", error)
            with self._lock:
                self.error = error if isinstance(error, EngineDeadError) else EngineDeadError(repr(error))
                sinks, self.sinks = list(self.sinks.values()), {}
            for sink in sinks:
                deliver(sink, self.error)
            self._results.put(self.error)
            self._closed.set()

    def _apply(self, steps: list[StepProgress]) -> None:
        deliveries: list[tuple[OutputSink, RequestOutput | BaseException]] = []
        now = time.monotonic()  # the steps' first tokens reach this process now (their TTFT)
        iteration_stats, iterations = self.frontend.book.iteration_stats, []
        with self._lock:
            progressed = {}
            for step in steps:
                for request_id, why in step.rejected:  # a request refused, or a completion that failed
                    parent_id, siblings = self.frontend.reject(request_id) or (request_id, [])
                    if siblings:  # the failed request's other completions stop in the core too
                        self._send(("abort", siblings))
                    sink = self.sinks.pop(parent_id, None)
                    if sink is not None:
                        deliveries.append((sink, ValueError(why)))
                for parent, finished in self.frontend.apply(step):
                    progressed[parent.request_id] = (parent, finished)
                if iteration_stats is not None:  # each step is its own, however many were read at once
                    iterations.append(iteration_stats.end_step(step.stats, step.num_step_tokens, step.timestamp, now))
            outputs = self.frontend.outputs(progressed.values())
            if iterations:
                iterations[-1].finished_requests = iteration_stats.finished(outputs, now)
            self.stats = steps[-1].stats  # before delivery: a finished caller sees its blocks freed
            for output in outputs:
                sink = self.sinks.pop(output.request_id, None) if output.finished else self.sinks.get(output.request_id)
                if sink is not None:
                    deliveries.append((sink, output))
        deliver_all(deliveries)
        for iteration in iterations:
            for stat_logger in self.stat_loggers:
                stat_logger.record_step(iteration)


def _is_dead(message: Any) -> bool:
    """The child's last word (a closed pipe reads as this too, again and again)."""
    return isinstance(message, tuple) and message[0] == "dead"
