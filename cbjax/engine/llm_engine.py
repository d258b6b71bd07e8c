"""LLMEngine: add_request / abort_request / step, the loop every front end drives."""

from __future__ import annotations

import collections
import logging
import operator
import time
from typing import Any

import jax
from flax import nnx

from cbjax.checkpoint.loader import load_model
from cbjax.checkpoint.resolve import resolve_model
from cbjax.models.config import ModelConfig
from cbjax.worker.distributed import multihost
from cbjax.core.kv.block_manager import BlockManager
from cbjax.worker.compilation.compile_cache import enable_compile_cache
from cbjax.config import EngineConfig
from cbjax.core.kv.sizing import plan_num_blocks
from cbjax.engine.output_processor import OutputProcessor
from cbjax.engine.parallel_sampling import ParentRequest, shares_prompt
from cbjax.worker.sample.penalty_state import penalty_state_bytes
from cbjax.engine.protocol import ChildState, StepProgress, empty_progress
from cbjax.core.request import Request, RequestStatus
from cbjax.engine.request_book import Prompt, RequestBook, tokenize_prompt
from cbjax.worker.model_runner import SUPPRESS_LEN, LaunchedStep, ModelRunner, kv_cache_dtype
from cbjax.core.sched.scheduler import Scheduler
from cbjax.worker.distributed.sharding import TensorParallel
from cbjax.models.registry import kv_cache_bytes_per_block
from cbjax.outputs import RequestOutput
from cbjax.sampling_params import SamplingParams
from cbjax.tokenizer.tokenizer import Tokenizer
from kernels_cpu import register_in_background
from cbjax.models.layers.attention import resolve_backend

logger = logging.getLogger(__name__)

class LLMEngine:
    """One model, one KV pool, one scheduler; `step()` advances every running request by one step."""

    def __init__(self, config: EngineConfig, *, precompile: bool = True, progress: bool = True):
        self.config = config
        config.model = str(resolve_model(config.model))
        multihost.initialize(config)  # before any device is touched
        device = jax.devices()[0]
        enable_compile_cache(config.compilation_cache_dir, device)
        self.platform = device.platform
        dtype = config.dtype if config.dtype != "auto" else ("float32" if device.platform == "cpu" else "bfloat16")
        # XLA:CPU has fast bf16 x bf16 -> f32 dots but slow bf16 arithmetic otherwise: on CPU,
        # 16-bit weights keep float32 activations and a float32 KV pool.
        activation_dtype = "float32" if device.platform == "cpu" else None
        tensor_parallel = None
        if config.tensor_parallel_size > 1:  # checked against the model before any weight is read
            tensor_parallel = TensorParallel.create(ModelConfig.from_dir(config.model), config.tensor_parallel_size)
        # On a CPU the C++ attention kernel may need building (seconds): it builds while the weights
        # load and the steps are traced; the runner waits for it before it compiles them.
        kernel_build = register_in_background() if device.platform == "cpu" and config.attention_backend in ("auto", "cpp") else None
        # Under TP, model_config counts KV heads after repetition (see cbjax/worker/distributed/sharding.py).
        pack_for_cpu = (kernel_build is not None and config.cpu_packed_weights and tensor_parallel is None
                        and config.num_processes == 1)
        # One device: q/k/v and gate/up as one kernel each (3 dots and 3 arrays fewer per layer).
        model, self.model_config = load_model(
            config.model, dtype=dtype, activation_dtype=activation_dtype, tensor_parallel=tensor_parallel,
            pack_for_cpu=pack_for_cpu, fused_projections=tensor_parallel is None,
        )
        config.resolve(self.model_config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        self.eos_token_ids = list(self.tokenizer.eos_token_ids or self.model_config.eos_token_id)
        mc = self.model_config
        backend = resolve_backend(
            config.attention_backend,
            num_q_heads=mc.num_attention_heads // config.tensor_parallel_size,  # one device's heads
            num_kv_heads=mc.num_key_value_heads // config.tensor_parallel_size,
            head_dim=mc.head_dim,
            block_size=config.block_size,
            wait_for_kernel=kernel_build is None,
        )
        reserved_bytes = 0
        if device.platform != "cpu" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
            # A profiled step: what the largest steps need besides the pool, measured on a 2-block pool.
            reserved_bytes = ModelRunner(model, mc, config, 2, backend, tensor_parallel).peak_step_bytes()
            # The penalty table is allocated with the runner, after the pool is sized: keep room for it.
            reserved_bytes += penalty_state_bytes(config.max_num_seqs, mc.vocab_size)
        num_blocks = plan_num_blocks(
            # Memory sizing is per device: each holds 1/tensor_parallel_size of every block.
            bytes_per_block=kv_cache_bytes_per_block(mc, config.block_size, kv_cache_dtype(config.kv_cache_dtype, model))
            // config.tensor_parallel_size,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            device=device,
            weights_bytes=sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(nnx.state(model))),
            reserved_bytes=reserved_bytes,
        )
        self.runner = ModelRunner(model, mc, config, num_blocks, backend, tensor_parallel)
        self.step_broadcast = multihost.attach(self.runner, config)
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            block_manager=self.block_manager,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_num_prefills=config.max_num_prefills,
            scheduling_policy=config.scheduling_policy,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.book = RequestBook(self.output_processor)
        # An engine core in its own process (engine_process.py) sends each step's progress, not
        # outputs: its front end makes the text and outputs, and stops requests by stop strings.
        self.sends_progress = False
        # Abort ids may arrive from any thread; deque appends and pops are atomic, and step() applies
        # them between device steps, so an abort never lands inside a step.
        self.pending_aborts: collections.deque[str] = collections.deque()
        self.num_steps = 0
        self.in_flight: LaunchedStep | None = None  # async scheduling: launched, its tokens not read yet
        self.last_step_num_tokens = 0  # tokens the latest step computed (prompt chunks + decodes)
        if precompile:
            start = time.perf_counter()
            self.runner.precompile(progress=progress)
            logger.info("compiled %d steps in %.1f s", len(self.runner.buckets), time.perf_counter() - start)

    # ---- requests -------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The attention backend the steps run with (the runner's: it falls back to "xla" if the C++ kernel's build fails)."""
        return self.runner.backend

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request (n > 1: one child request per completion); bad input raises ValueError
        and leaves the engine as it was. `priority` orders it under the priority scheduling policy
        (lower first)."""
        params = sampling_params or SamplingParams()
        self.scheduler.check_priority(priority)
        self.book.check_free(request_id, params.n)
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        params.update_from_tokenizer(self.tokenizer.encode_chat)  # bad_words to token ids, no special tokens
        self._validate(token_ids, params)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        children = self.book.add_new(
            request_id, token_ids, params, self.eos_token_ids, arrival_time, text, priority).children
        if self.sends_progress:
            self._unstarted.update(children)
        wait_for = children[0] if shares_prompt(params, self.config.enable_prefix_caching) else None
        for child in children:
            self.scheduler.add_request(child, wait_for if child is not children[0] else None)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_model_len, vocab = self.config.max_model_len, self.model_config.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); "
                "use ids from this model's tokenizer"
            )
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {max_model_len} "
                "(prompt plus at least one output token); raise max_model_len or shorten the prompt"
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens and max_tokens={params.max_tokens}, "
                f"{len(token_ids) + params.max_tokens} in all; max_model_len is {max_model_len}; "
                "lower max_tokens, shorten the prompt or raise max_model_len"
            )
        suppressed = len(params.stop_token_ids) + (0 if params.ignore_eos else len(self.eos_token_ids))
        if params.min_tokens > 0 and suppressed > SUPPRESS_LEN:
            raise ValueError(
                f"min_tokens={params.min_tokens} would hold back {suppressed} stop and eos token ids; "
                f"at most {SUPPRESS_LEN} are supported; pass fewer stop_token_ids or min_tokens=0"
            )
        params.check_token_ids(vocab)  # logit_bias, allowed_token_ids, bad_words
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(
                    f"{name}={value} exceeds max_logprobs={self.config.max_logprobs}; "
                    "ask for fewer or raise max_logprobs"
                )

    def abort_request(self, request_id: str) -> None:
        """Stop a request (safe from any thread); its output so far comes back from the next step()
        with reason "abort". Unknown or finished ids are ignored."""
        self.pending_aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.pending_aborts) or self.in_flight is not None

    # ---- the loop -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a device step, record a step's tokens: the outputs of requests that progressed.

        The step recorded is the one just launched, or with async scheduling the one launched
        before it, read while the new one runs (which takes its decode tokens from that step's
        output on the device): the host's work overlaps the device's. An engine core that sends
        progress (send_progress) returns a StepProgress instead.
        """
        aborted = self._apply_aborts()
        if self.in_flight is not None and not self._overlaps():
            # Overlapping stops: read the step in flight now and schedule the next one on the next
            # call, so each call still reports one step (an abort between calls lands exactly).
            launched, self.in_flight = self.in_flight, None
            return self._report(aborted, launched)
        scheduled = self.scheduler.schedule()
        self.last_step_num_tokens = scheduled.num_scheduled_tokens
        launched = self.runner.dispatch(scheduled) if scheduled.scheduled else None
        self.num_steps += launched is not None
        if self.in_flight is not None or self._overlaps():  # a step in flight is always read before this one
            launched, self.in_flight = self.in_flight, launched
        return self._report(aborted, launched)

    def _report(self, aborted: list[ParentRequest], launched: LaunchedStep | None) -> Any:
        if self.sends_progress:
            return self._progress(aborted, launched)
        outputs = [self.book.finish(parent) for parent in aborted]
        if launched is not None:
            outputs += self._record(launched)
        return outputs

    def send_progress(self) -> None:
        """Make this engine an engine core whose front end is elsewhere (engine_process.py): step()
        returns StepProgress, and text, stop strings and outputs are the front end's. Call it
        before any request is added."""
        self.sends_progress = True
        self.book.output_processor = None
        self._sent_rows: tuple[Request, ...] = ()  # the rows of the step sent last
        self._unstarted: set[Request] = set()  # requests added that have no output token yet

    def stop_request(self, child_id: str) -> None:
        """Finish one child request a stop string ended (the front end found it); like an abort it
        lands between steps, and a step in flight skips its row."""
        if child_id in self.book.parents:
            request = self.scheduler.finish_request(child_id, RequestStatus.FINISHED_STOPPED)
            if request is not None:
                self._forget_finished(request)

    def _forget_finished(self, request: Request) -> None:
        """An engine core's finished child: its slot freed, its parent forgotten once all its children are done."""
        self.runner.release_request(request.request_id)
        parent = self.book.parents[request.request_id]
        if parent.finished:
            self.book.forget(parent)

    def _overlaps(self) -> bool:
        """Whether this step reads the previous step's tokens (async scheduling) or its own.

        async_scheduling=None ("auto", `cbjax serve`'s default): always on an accelerator. On a CPU
        only while every seat is taken: there the step runs on the host's own cores, and a prompt
        that arrives while one step runs, with a seat free, would wait for the step already
        launched behind it too (one more decode step of time to first token); with no seat free
        it waits for a seat anyway, and overlapping keeps a full server's throughput.
        """
        mode = self.config.async_scheduling
        if mode is None:
            return self.platform != "cpu" or len(self.scheduler.running) >= self.config.max_num_seqs
        return mode

    def _apply_aborts(self) -> list[ParentRequest]:
        aborted = []
        while self.pending_aborts:
            parent = self.book.requests.get(self.pending_aborts.popleft())
            if parent is not None:
                for child in parent.children:
                    self.scheduler.abort_request(child.request_id)
                    self.runner.release_request(child.request_id)
                aborted.append(parent)
        return aborted

    def _record(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens into its requests, and their outputs (RequestBook.progressed
        says which). A request finished since the step was launched is skipped: its blocks and
        penalty slot are already free."""
        sampled, prompt_logprobs = self.runner.collect(launched)
        for row in launched.scheduled.scheduled if prompt_logprobs else ():
            if not row.request.is_finished and row.request.request_id in prompt_logprobs:
                self.output_processor.add_prompt_logprobs(row.request.request_id, prompt_logprobs[row.request.request_id])
        finished_now = self.scheduler.update(launched.scheduled, sampled.token_ids)
        progressed = self.book.progressed(sampled, finished_now, self._stop, self._release)
        return self.book.outputs(progressed)

    def _progress(self, aborted: list[ParentRequest], launched: LaunchedStep | None) -> StepProgress:
        """The step as an engine core sends it: tokens and finishes, no text (see progress.py)."""
        aborted_children = [ChildState.of(child) for parent in aborted for child in parent.children]
        for parent in aborted:
            self.book.forget(parent)
        if launched is None:
            return empty_progress(self.get_stats(), aborted=aborted_children)
        sampled, prompt_logprobs = self.runner.collect(launched)
        rows = sampled.sampling_requests
        skipped_requests: list[Request] = []  # finished since the step was launched: update skips their tokens
        finished_now = self.scheduler.update(launched.scheduled, sampled.token_ids, skipped_requests)
        skipped = [row for row, request in enumerate(rows) if request in skipped_requests] if skipped_requests else []
        for request in finished_now:
            self._forget_finished(request)
        # The same request objects as the step sent last (a decode over the same batch): the front
        # end keeps its mirrors of them (ids alone could name a new request reusing a finished one's id).
        previous = self._sent_rows
        same_rows = len(rows) == len(previous) and all(map(operator.is_, rows, previous))
        self._sent_rows = rows
        # Requests whose first token came: looked for among those without one (a few, not every row).
        started = [request for request in self._unstarted if request.output_token_ids or request.is_finished]
        for request in started:
            self._unstarted.remove(request)
        return StepProgress(
            rejected=[], aborted=aborted_children,
            row_ids=None if same_rows else [request.request_id for request in rows], skipped=skipped,
            token_ids=sampled.token_ids,
            # The logprob columns only where a row asked for logprobs (they then have a `top`).
            logprobs=sampled.logprobs if sampled.top else [], ranks=sampled.ranks if sampled.top else [],
            top=sampled.top, prompt_logprobs=prompt_logprobs,
            started=[ChildState.of(request) for request in started if request.output_token_ids],
            finished=[ChildState.of(request) for request in finished_now],
            preempted=launched.scheduled.preempted_request_ids,
            stats=self.get_stats(), num_step_tokens=self.last_step_num_tokens,
        )

    def _stop(self, request: Request) -> None:
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _release(self, request: Request) -> None:
        self.runner.release_request(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block; False (and nothing done) while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def get_stats(self) -> dict[str, Any]:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_total": self.block_manager.num_blocks - 1,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "prefix_cache_queries": self.block_manager.prefix_cache_queries,
            "prefix_cache_hits": self.block_manager.prefix_cache_hits,
            "prefix_cache_hit_rate": self.block_manager.prefix_cache_hits / max(1, self.block_manager.prefix_cache_queries),
            "attention_backend": self.backend,
            "buckets": len(self.runner.buckets),
        }
