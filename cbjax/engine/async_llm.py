"""AsyncLLM (vLLM's name): the engine for asyncio callers, e.g. the OpenAI server.

The engine core steps the engine in its own thread; AsyncLLM gives each request an asyncio
queue that the core fills, and an async iterator over it. Leaving the iterator early (a client
that disconnects, a cancelled task) aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cbjax.engine.config import EngineConfig
from cbjax.engine.core import EngineCore, EngineDeadError, StatLogger
from cbjax.engine.engine import LLMEngine, Prompt
from cbjax.engine.output_kinds import OutputKindView
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer import Tokenizer


class AsyncLLM:
    """Load and compile like `LLM(model, **options)`, then serve concurrent `generate` calls."""

    def __init__(self, model: str, *, stat_loggers: Sequence[StatLogger] = (), progress: bool = True, **options: Any):
        self.engine_config = EngineConfig(model=model, **options)
        engine = LLMEngine(self.engine_config, progress=progress)
        self.tokenizer: Tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.core = EngineCore(engine, stat_loggers)
        self.core.start()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, shaped by `sampling_params.output_kind`.

        Raises ValueError (bad input, from add_request) or EngineDeadError.
        """
        self.check_health()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.core.add_request(
            request_id, prompt, sampling_params, lambda item: loop.call_soon_threadsafe(outputs.put_nowait, item)
        )
        view = OutputKindView(sampling_params.output_kind)
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # rejected or engine dead: nothing to abort
                    raise item
                finished = item.finished
                shown = view.apply(item)
                if shown is not None:
                    yield shown
        finally:
            if not finished:  # the caller left early (cancelled, closed, disconnected)
                self.core.abort_request(request_id)

    async def abort(self, request_id: str) -> None:
        self.core.abort_request(request_id)

    async def get_stats(self) -> dict[str, Any]:
        """The engine's stats as of the latest step (num_running, num_waiting, kv_blocks_free, ...)."""
        return dict(self.core.stats)

    def check_health(self) -> None:
        """Raise EngineDeadError once the engine-core loop has stopped."""
        if not self.core.is_alive:
            raise EngineDeadError(f"the engine-core loop is not running ({self.core.error!r})")

    @property
    def errored(self) -> bool:
        return not self.core.is_alive

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort every request left, deliver their final outputs, stop the core thread."""
        self.core.shutdown(timeout)
