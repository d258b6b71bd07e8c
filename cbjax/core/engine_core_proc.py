"""The engine core in its own process (vLLM V1's EngineCoreProc): the child's end of the pipe.

The front end's end is engine/process_client.py. The child builds an EngineCore, then applies the
front end's commands between steps and sends each step's progress (protocol.py) down the pipe:
tokens and finishes, no text (the front end makes text, checks stop strings and makes outputs).
"""

from __future__ import annotations

import logging
import operator
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from cbjax.config import EngineConfig
from cbjax.core.engine_core import EngineCore
from cbjax.core.protocol import ChildState, StepProgress, empty_progress
from cbjax.core.request import Request

logger = logging.getLogger(__name__)


def build_engine_core(options: dict[str, Any], progress: bool = True) -> EngineCore:
    """The child's core: `LLM(model, **options)`'s (options holds `model`)."""
    from cbjax.worker.build import build_worker  # the device side: loaded in this process only

    config = EngineConfig(**options)
    worker = build_worker(config, progress=progress)
    return EngineCore(config, worker.runner, worker.model_config, worker.platform, worker.drafter)


class EngineCoreProc:
    """An EngineCore whose front end is in another process: its steps as StepProgress."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.rejected: list[tuple[str, str]] = []  # (request id, why) since the last message sent
        self.aborted: list[ChildState] = []  # children aborted since the last message sent
        self.sent_rows: tuple[Request, ...] = ()  # the rows of the step sent last
        self.unstarted: set[Request] = set()  # requests added that have no output token yet

    def add_request(self, request_id: str, completions: Sequence[Request]) -> None:
        """Queue a request's completions (the front end's mirrors, as sent); a bad one is rejected
        in the next message, with ValueError's message."""
        first = completions[0]
        try:
            self.core.check_request(first.prompt_token_ids, first.sampling_params, first.eos_token_ids, first.priority,
                                    first.lora_request)
            self.core.add_requests(completions)
        except (ValueError, TypeError) as error:  # bad input: the caller hears why, the others carry on
            self.rejected.append((request_id, str(error)))
            return
        self.unstarted.update(completions)

    def abort_request(self, request_id: str) -> None:
        request = self.core.abort_request(request_id)
        if request is not None:
            self.aborted.append(ChildState.of(request))

    def pending_message(self) -> StepProgress | None:
        """Rejections and aborts waiting for a message, sent without a step."""
        if not (self.rejected or self.aborted):
            return None
        return self._unsent(empty_progress(self.core.get_stats()))

    def _unsent(self, progress: StepProgress) -> StepProgress:
        progress.rejected, progress.aborted, self.rejected, self.aborted = self.rejected, self.aborted, [], []
        return progress

    def step(self) -> StepProgress:
        """One core step as the front end reads it (see protocol.py)."""
        core = self.core
        step = core.step()
        if core.failed:  # completions it could not prepare: their requests fail (the front end finds the parent)
            self.rejected += [(request.request_id, why) for request, why in core.take_failed()]
        if step.sampled is None:
            return self._unsent(empty_progress(core.get_stats(), num_step_tokens=core.last_step_num_tokens))
        rows = step.sampled.sampling_requests
        skipped = [row for row, request in enumerate(rows) if request in step.skipped] if step.skipped else []
        # The same request objects as the step sent last (a decode over the same batch): the front
        # end keeps its mirrors of them (ids alone could name a new request reusing a finished one's id).
        previous = self.sent_rows
        same_rows = len(rows) == len(previous) and all(map(operator.is_, rows, previous))
        self.sent_rows = rows
        # Requests whose first token came: looked for among those without one (a few, not every row).
        started = [request for request in self.unstarted if request.output_token_ids or request.is_finished]
        for request in started:
            self.unstarted.remove(request)
        sampled = step.sampled
        return self._unsent(StepProgress(
            rejected=[], aborted=[],
            row_ids=None if same_rows else [request.request_id for request in rows], skipped=skipped,
            token_ids=sampled.token_ids,
            # The logprob columns only where a row asked for logprobs (they then have a `top`).
            logprobs=sampled.logprobs if sampled.top else [], ranks=sampled.ranks if sampled.top else [],
            top=sampled.top, prompt_logprobs=step.prompt_logprobs,
            started=[ChildState.of(request) for request in started if request.output_token_ids],
            finished=[ChildState.of(request) for request in step.finished],
            preempted=step.preempted,
            stats=core.get_stats(), num_step_tokens=core.last_step_num_tokens, timestamp=time.monotonic(),
            runs=sampled.runs,
        ))


def run_engine_core(conn: Connection, build: Callable[..., EngineCore], build_args: tuple) -> None:
    """The child's main: build the core, then apply commands and step while there is work,
    sending every step's progress."""
    from cbjax.heap import freeze_gc_heap

    # A terminal's Ctrl-C reaches the whole process group: the parent decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = build(*build_args)
    except BaseException as error:  # noqa: BLE001 (whatever stops the start is the parent's to report)
        # Bad options say what to change; anything else leaves its traceback here too.
        (logger.debug if isinstance(error, (ValueError, TypeError)) else logger.exception)(
            "the engine core failed to start", exc_info=True)
        try:
            conn.send(("failed", error))  # raised again in the parent, as LLMEngine would raise it there
        except Exception:  # noqa: BLE001 (an exception that cannot be pickled)
            conn.send(("dead", f"the engine core failed to start: {error!r}"))
        return
    conn.send(("ready", core.config, core.model_config, core.get_stats(), core.limits))
    freeze_gc_heap()  # this process serves one engine until it exits: no GC pauses over its start-up objects
    try:
        _serve(conn, EngineCoreProc(core))
    except (EOFError, BrokenPipeError):  # the front end's process is gone: nobody to serve
        return
    except BaseException as error:  # noqa: BLE001
        logger.exception("the engine-core loop died")
        conn.send(("dead", f"the engine-core loop died: {error!r}"))


def _serve(conn: Connection, proc: EngineCoreProc) -> None:
    # Commands are read as they come, in a thread of their own: a step, or a send of progress that
    # waits for the front end, never leaves the front end's sends waiting (vLLM's input socket thread).
    commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(conn, commands), name="cbjax-core-input", daemon=True).start()
    core, serving = proc.core, True
    while serving:
        command = commands.get() if not core.has_unfinished_requests() else _next_command(commands)  # idle: wait
        applied = command is not None
        while command is not None:
            serving = _apply(command, conn, proc)
            command = _next_command(commands) if serving else None
        if core.has_unfinished_requests():
            conn.send(proc.step())
        elif applied:  # no step to carry them: the rejections, and the stats after a stop freed blocks
            conn.send(proc.pending_message() or empty_progress(core.get_stats()))
    while core.has_unfinished_requests():  # shutting down: the aborts' outputs
        conn.send(proc.step())
    if (message := proc.pending_message()) is not None:  # aborts no step carried (nothing was in flight)
        conn.send(message)
    conn.send(("closed",))


def _read_commands(conn: Connection, commands: queue.SimpleQueue[tuple]) -> None:
    """The input thread: every command the front end sends, onto `commands`."""
    try:
        while True:
            commands.put(conn.recv())
    except (EOFError, OSError):
        commands.put(("gone",))
    except BaseException as error:  # noqa: BLE001 (a command that cannot be unpickled: the loop dies of it)
        commands.put(("unreadable", error))


def _next_command(commands: queue.SimpleQueue[tuple]) -> tuple | None:
    try:
        return commands.get_nowait()
    except queue.Empty:
        return None


def _apply(command: tuple, conn: Connection, proc: EngineCoreProc) -> bool:
    """Apply one command; False once shutdown was asked (every request left is aborted)."""
    kind = command[0]
    if kind == "add":
        for request_id, completions in command[1]:
            proc.add_request(request_id, completions)
    elif kind == "abort":
        for child_id in command[1]:
            proc.abort_request(child_id)
    elif kind == "stop":
        proc.core.stop_request(command[1])
    elif kind == "call":
        _, function, args = command
        try:
            result = function(proc.core, *args)
        except Exception as error:  # the caller's probe failed, not the engine
            result = error
        conn.send(("result", result))
    elif kind == "gone":
        raise EOFError("the front end's process is gone")
    elif kind == "unreadable":
        raise command[1]
    else:  # "shutdown"
        for request_id in list(proc.core.scheduler.requests):
            proc.abort_request(request_id)
        return False
    return True
