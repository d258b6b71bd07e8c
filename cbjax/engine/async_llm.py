"""AsyncLLM (vLLM's name): the engine for asyncio callers, e.g. the OpenAI server.

A core client steps the engine: in its own thread (core_client.py), or with engine_process=True
in its own process, this one making the text and outputs (process_client.py, vLLM V1's split); AsyncLLM
gives each request an asyncio queue that the core fills, and an async iterator over it. Leaving
the iterator early (a client that disconnects, a cancelled task) aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from cbjax.config import EngineConfig
from cbjax.core.engine_core_proc import build_engine_core
from cbjax.core.request_checks import check_request
from cbjax.engine.core_client import LoopQueueSink, StatLogger, ThreadCoreClient
from cbjax.engine.exceptions import EngineDeadError
from cbjax.engine.llm_engine import LLMEngine, Prompt
from cbjax.engine.process_client import ProcessCoreClient
from cbjax.engine.request_book import tokenize_request
from cbjax.lora.request import LoRARequest
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer


StatLoggerFactory = Callable[[EngineConfig], StatLogger]


class AsyncLLM:
    """Load and compile like `LLM(model, **options)`, then serve concurrent `generate` calls.

    stat_loggers: factories (vLLM's StatLoggerFactory) called with the resolved EngineConfig; the
    loggers they make see every step's outputs, in the engine-core thread (with engine_process:
    in the thread that reads the core's steps).
    engine_process: run the engine core in a child process (see process_client.py); the model is
    loaded and compiled there, and this process only tokenizes, detokenizes and makes outputs.
    """

    def __init__(
        self, model: str, *, stat_loggers: Sequence[StatLoggerFactory] = (), progress: bool = True,
        engine_process: bool = False, **options: Any,
    ):
        if not engine_process:
            self._attach(LLMEngine(EngineConfig(model=model, **options), progress=progress), stat_loggers)
            return
        core = ProcessCoreClient(build_engine_core, ({"model": model, **options}, progress), stat_loggers)
        self.engine_config, self.tokenizer, self.model_config = core.engine_config, core.tokenizer, core.model_config
        self.request_limits, self.eos_token_ids = core.request_limits, core.frontend.eos_token_ids
        self.core = core
        core.start()

    @classmethod
    def from_engine(cls, engine: LLMEngine, stat_loggers: Sequence[StatLoggerFactory] = ()) -> AsyncLLM:
        """Serve an engine built already; from now on only the engine-core thread touches it."""
        async_llm = cls.__new__(cls)
        async_llm._attach(engine, stat_loggers)
        return async_llm

    def _attach(self, engine: LLMEngine, stat_loggers: Sequence[StatLoggerFactory]) -> None:
        self.engine_config = engine.config
        self.tokenizer: Tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.request_limits, self.eos_token_ids = engine.core.limits, engine.eos_token_ids
        self.core = ThreadCoreClient(engine, [make(self.engine_config) for make in stat_loggers])
        self.core.start()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def check_request(self, prompt: Prompt, sampling_params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError, saying what to change, for a request `generate` would reject: the same
        checks, here and now (a server answers 400 before it opens a stream). It tokenizes the
        prompt as `generate` does."""
        _, token_ids = tokenize_request(self.tokenizer, prompt, sampling_params)
        check_request(self.request_limits, token_ids, sampling_params, self.eos_token_ids, priority)

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams, request_id: str, *, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, shaped by `sampling_params.output_kind`; `priority`
        orders it under the priority scheduling policy (lower first); `lora_request` runs it under
        that LoRA adapter (enable_lora).

        Raises ValueError (bad input, from add_request) or EngineDeadError.
        """
        self.check_health()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.core.add_request(request_id, prompt, sampling_params, LoopQueueSink(loop, outputs), priority, lora_request)
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # rejected or engine dead: nothing to abort
                    raise item
                finished = item.finished
                yield item  # shaped by its output kind (FINAL_ONLY: the last alone)
        finally:
            if not finished:  # the caller left early (cancelled, closed, disconnected)
                self.core.abort_request(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check a LoRA adapter in the engine core now (vLLM's add_lora); ValueError if it is bad."""
        await asyncio.to_thread(self.core.call, _add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter in the engine core; False if none has that id."""
        return await asyncio.to_thread(self.core.call, _remove_lora, lora_int_id)

    async def abort(self, request_id: str) -> None:
        self.core.abort_request(request_id)

    async def get_stats(self) -> dict[str, Any]:
        """The engine's stats as of the latest step (num_running, num_waiting, kv_blocks_free, ...)."""
        return dict(self.core.stats)

    def num_waiting_requests(self) -> int:
        """Requests waiting for a seat, as of the latest step (new ones may still find a free seat)."""
        return self.core.stats["num_waiting"]

    def check_health(self) -> None:
        """Raise EngineDeadError once the engine-core loop has stopped."""
        if not self.core.is_alive:
            raise EngineDeadError(f"the engine-core loop is not running ({self.core.error!r})")

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort every request left, deliver their final outputs, stop the core thread."""
        self.core.shutdown(timeout)


def _add_lora(core: Any, lora_request: LoRARequest) -> None:  # (module level: it is pickled to an engine process)
    core.add_lora(lora_request)


def _remove_lora(core: Any, lora_int_id: int) -> bool:
    return core.remove_lora(lora_int_id)
