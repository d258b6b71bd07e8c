"""ModelRunner: buckets, input packing, precompilation and step dispatch.

Every step is one call of an executable compiled at start-up: the host packs
the step's metadata into one int32 buffer (one transfer in), the pool and the
penalty state are donated (updated in place), sampling runs inside the step, and
the sampled tokens, their logprobs and any prompt logprobs come back packed in
one buffer (one transfer out).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int
from tqdm.auto import tqdm

from cbjax.engine.buckets import Bucket, compute_buckets, pick_bucket, step_shapes
from cbjax.engine.compile_cache import StepCache, compile_cache_folder
from cbjax.engine.logprobs import TokenLogprobs, prompt_logprobs
from cbjax.engine.packing import PackedLayout, pack, pack_device, unpack, unpack_host
from cbjax.engine.penalty_state import NO_SLOT, PenaltySlots, init_penalty_state, record_step_tokens
from cbjax.engine.sampler import SamplerOutput, SamplingRow, SamplingTensors, build_sampling_tensors, sample
from cbjax.engine.scheduler import SchedulerOutput
from cbjax.engine.sharding import TensorParallel, step_shardings
from cbjax.models.llama import init_kv_caches
from kernels_pallas.backend import AttentionPlan
from kernels_pallas.reference import AttentionMetadata

logger = logging.getLogger(__name__)

# Width of the per-row list of tokens forbidden while a request is under min_tokens (eos + stop ids).
SUPPRESS_LEN = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything a step reads besides the weights and the pool (numpy on host, arrays in the step)."""

    token_ids: Int[Array, "tokens"]
    positions: Int[Array, "tokens"]
    logits_indices: Int[Array, "reqs"]  # last new token of each sampling request, compacted
    attention: AttentionMetadata
    sampling: SamplingTensors
    token_penalty_slots: Int[Array, "tokens"]  # the token's request's penalty slot, NO_SLOT without penalties
    token_prompt_lens: Int[Array, "tokens"]  # its request's prompt length (penalty rows only)
    prompt_logprob_targets: Int[Array, "tokens"]  # the next prompt token, where prompt_logprobs asked; else -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """What a step sends back, in one buffer."""

    sampled: SamplerOutput  # per sampling row
    prompt: TokenLogprobs  # per token row: the logprob of prompt_logprob_targets


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """One request's result of a step, on the host."""

    token_id: int
    logprob: float
    rank: int  # over the whole vocabulary (vLLM's); 0 unless the request asked for logprobs
    top_token_ids: list[int]  # empty unless the request asked for logprobs
    top_logprobs: list[float]


@dataclasses.dataclass(frozen=True)
class PromptLogprobsChunk:
    """Logprobs of prompt tokens start, start + 1, ... of one request, scored in one step."""

    start: int  # index in the prompt of the first token scored (>= 1: the first has no logprob)
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


def kv_cache_dtype(requested: str, model: nnx.Module) -> jnp.dtype:
    """The pool's dtype: the model's activation dtype, unless the user asked for another."""
    return model.activation_dtype if requested == "auto" else jnp.dtype(requested)


def request_seed(engine_seed: int, request_id: str, seed: int | None) -> int:
    """A request's own seed, or one derived from the engine seed and its id (stable across runs)."""
    if seed is not None:
        return seed & 0x7FFFFFFF
    return zlib.crc32(f"{engine_seed}:{request_id}".encode()) & 0x7FFFFFFF


class ModelRunner:
    """Owns the weights, the KV pool and the compiled steps."""

    def __init__(
        self, model: nnx.Module, model_config: Any, config: Any, num_blocks: int, backend: str,
        tensor_parallel: TensorParallel | None = None,
    ):
        self.model_config = model_config
        self.tensor_parallel = tensor_parallel
        self.config = config
        self.backend = backend
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.graphdef, state = nnx.split(model)
        if tensor_parallel is not None:
            state = tensor_parallel.shard_state(state)
        # The weights travel as a flat list: flattening nnx's State pytree on every call cost
        # about 4 ms of dispatch per step.
        self.weights, self._state_treedef = jax.tree_util.tree_flatten(state)
        init_pool = functools.partial(
            init_kv_caches, model_config, num_blocks, config.block_size, kv_cache_dtype(config.kv_cache_dtype, model)
        )
        # Under TP each device allocates only its own KV heads.
        self.kv_caches = init_pool() if tensor_parallel is None else jax.jit(init_pool, out_shardings=tensor_parallel.pool_sharding)()
        self.penalty_state = init_penalty_state(config.max_num_seqs, model_config.vocab_size)
        if tensor_parallel is not None:  # the sampler reads whole vocabulary rows on every device
            self.penalty_state = jax.device_put(self.penalty_state, tensor_parallel.replicated)
        self.penalty_slots = PenaltySlots(config.max_num_seqs)
        self._shardings = {} if tensor_parallel is None else step_shardings(tensor_parallel, self.weights)
        self.buckets = compute_buckets(config.max_num_seqs, config.max_num_batched_tokens)
        self.compiled: dict[Bucket, Any] = {}
        self._warned_on_demand = False  # a step compiled while serving stalls it: say so, once
        self._layouts = {bucket: PackedLayout.of(self._host_inputs(bucket)) for bucket in self.buckets}
        self._out_layouts = {bucket: PackedLayout.of(self._host_outputs(bucket)) for bucket in self.buckets}
        self._bucket_index = {bucket: i for i, bucket in enumerate(self.buckets)}
        self.step_broadcast: Any = None  # multi-host leader: sends each step to the workers (engine/multihost.py)
        # Whole compiled steps, keyed without tracing (one device only: sharded steps go through JAX's cache alone).
        folder = compile_cache_folder(config.compilation_cache_dir, jax.devices()[0])
        single_device = tensor_parallel is None and getattr(config, "num_processes", 1) == 1
        self.step_cache = StepCache(folder) if folder is not None and single_device else None

    # ---- shapes -------------------------------------------------------------

    def _host_inputs(self, bucket: Bucket, sampling_rows: list[SamplingRow] = ()) -> StepInputs:
        """Host buffers of one bucket, zeroed: padded rows attend to nothing and write to the null block."""
        num_tokens, num_reqs = bucket.num_tokens, bucket.num_reqs
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return StepInputs(
            token_ids=zeros(num_tokens),
            positions=zeros(num_tokens),
            logits_indices=zeros(num_reqs),
            attention=AttentionMetadata(
                slot_mapping=zeros(num_tokens),
                query_start_loc=zeros(num_reqs + 1),
                seq_lens=zeros(num_reqs),
                block_tables=zeros(num_reqs, self.max_blocks_per_seq),
            ),
            sampling=build_sampling_tensors(sampling_rows, num_reqs, SUPPRESS_LEN),
            token_penalty_slots=np.full(num_tokens, NO_SLOT, np.int32),
            token_prompt_lens=zeros(num_tokens),
            prompt_logprob_targets=np.full(num_tokens, -1, np.int32),
        )

    def _host_outputs(self, bucket: Bucket) -> StepOutputs:
        def logprobs(num_rows: int) -> TokenLogprobs:
            k = self.config.max_logprobs
            return TokenLogprobs(np.zeros(num_rows, np.float32), np.zeros(num_rows, np.int32),
                                 np.zeros((num_rows, k), np.int32), np.zeros((num_rows, k), np.float32))

        return StepOutputs(SamplerOutput(np.zeros(bucket.num_reqs, np.int32), logprobs(bucket.num_reqs)),
                           logprobs(bucket.num_tokens))

    # ---- the step -----------------------------------------------------------

    def _step_fn(self, bucket: Bucket, backend: str):
        graphdef, layout, num_logprobs = self.graphdef, self._layouts[bucket], self.config.max_logprobs
        state_treedef = self._state_treedef
        mesh = None if self.tensor_parallel is None else self.tensor_parallel.mesh

        def step(weights, kv_caches, penalty_state, packed):
            inputs: StepInputs = unpack(packed, layout)
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, weights))
            hidden, kv_caches = model.hidden_states(
                inputs.token_ids,
                inputs.positions,
                kv_caches,
                inputs.attention,
                AttentionPlan(backend, bucket.kind == "decode", self.config.max_num_prefills, mesh),
            )
            logits = model.compute_logits(hidden[inputs.logits_indices])
            if mesh is not None:  # the sampler reads whole vocabulary rows
                logits = jax.lax.with_sharding_constraint(logits, self.tensor_parallel.replicated)
            penalty_state = record_step_tokens(penalty_state, inputs.token_ids, inputs.positions,
                                               inputs.token_penalty_slots, inputs.token_prompt_lens)
            outputs = StepOutputs(
                sample(logits, inputs.sampling, penalty_state, num_logprobs),
                prompt_logprobs(model.compute_logits, hidden, inputs.prompt_logprob_targets, num_logprobs),
            )
            return kv_caches, penalty_state, pack_device(outputs)

        return jax.jit(step, donate_argnums=(1, 2), **self._shardings)

    def _packed_struct(self, bucket: Bucket) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.packed_size(bucket),), jnp.int32)

    def packed_size(self, bucket: Bucket) -> int:
        return self._layouts[bucket].size

    def launch(self, bucket: Bucket, packed: Int[np.ndarray, "size"]) -> jax.Array:
        """Start one step on the packed inputs; its packed result (fully replicated, so any process reads it).

        The one place a step is launched: a multi-host leader first sends the step to the workers,
        which then launch the same step on their own devices.
        """
        if self.step_broadcast is not None:
            self.step_broadcast.send_step(self._bucket_index[bucket], packed)
        self.kv_caches, self.penalty_state, result = self._executable(bucket)(
            self.weights, self.kv_caches, self.penalty_state, packed
        )
        return result

    def precompile(self, progress: bool = True, buckets: list[Bucket] | None = None) -> None:
        """Compile every bucket now (or only `buckets`, for a caller that knows its steps), so that
        serving never compiles.

        XLA compiles outside the GIL, so buckets compile on all cores at once. They are traced
        one after another first: tracing in parallel threads made the HLO differ from run to run
        (a constant shared by the layers was sometimes built twice), so the persistent
        compilation cache missed. Buckets that lower to the same program share one executable.
        """
        buckets = self.buckets if buckets is None else buckets
        logger.info("step buckets (kind, tokens, requests): %s", [(b.kind, b.num_tokens, b.num_reqs) for b in buckets])
        shapes = self._step_shapes(buckets)
        programs = list(dict.fromkeys(shapes.values()))
        keys = {shape: self._step_key(shape) for shape in programs} if self.step_cache is not None else {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            loaded = dict(zip(keys, pool.map(self.step_cache.load, keys.values()))) if keys else {}
            executables = {shape: executable for shape, executable in loaded.items() if executable is not None}
            lowered = {shape: self._lower(shape) for shape in programs if shape not in executables}
            futures = {pool.submit(StepCache.compile_fresh, lowered[shape]): shape for shape in lowered}
            done = concurrent.futures.as_completed(futures)
            for future in tqdm(done, total=len(futures), desc="compiling steps", disable=not progress or not futures):
                shape = futures[future]
                executables[shape], fresh = future.result()
                if fresh and shape in keys:
                    self.step_cache.store(keys[shape], executables[shape])
        for bucket, shape in shapes.items():
            self.compiled[bucket] = executables[shape]
        self.warm_up()

    def _step_shapes(self, buckets: list[Bucket]) -> dict[Bucket, Bucket]:
        # The C++ kernel runs a decode-only step as it runs a mixed one (AttentionPlan.decode_only unused).
        return step_shapes(buckets, decode_runs_as_mixed=self.backend == "cpp")

    @functools.cached_property
    def _step_key_base(self) -> str:
        """The part of every step's StepCache key that does not depend on the bucket."""
        avals = lambda tree: [(x.shape, x.dtype, x.sharding) for x in jax.tree_util.tree_leaves(tree)]  # noqa: E731
        options = {k: v for k, v in vars(self.config).items() if k not in ("model", "tokenizer")}
        return StepCache.key((
            self.graphdef, self._state_treedef, avals(self.weights), avals(self.kv_caches), avals(self.penalty_state),
            self.backend, StepCache.kernel_build(self.backend), sorted(options.items()),
        ))

    def _step_key(self, bucket: Bucket) -> str:
        """The StepCache key of `bucket`'s program: everything it is traced from besides the code."""
        return StepCache.key((self._step_key_base, self._layouts[bucket], self._out_layouts[bucket], bucket))

    def _lower(self, bucket: Bucket) -> jax.stages.Lowered:
        return self._step_fn(bucket, self.backend).lower(
            self.weights, self.kv_caches, self.penalty_state, self._packed_struct(bucket)
        )

    def _executable(self, bucket: Bucket) -> Any:
        """The compiled step of `bucket`, compiled now if start-up skipped it (precompile=False)."""
        compiled = self.compiled.get(bucket)
        if compiled is None:
            shapes = self._step_shapes(self.buckets)
            compiled = next((self.compiled[b] for b in self.compiled if shapes[b] == shapes[bucket]), None)
        if compiled is None:
            if not self._warned_on_demand:
                self._warned_on_demand = True
                logger.warning(
                    "the engine was built with precompile=False: each step shape is compiled the first time "
                    "it is needed, and serving stalls while it compiles (seconds per shape); "
                    "keep precompile=True (the default) to compile all %d shapes at start-up",
                    len(self.buckets),
                )
            logger.info("compiling step bucket %s on demand", bucket)
            compiled = self._lower(bucket).compile()
        self.compiled[bucket] = compiled
        return compiled

    def warm_up(self) -> None:
        """Run every compiled step once on a one-token request that lives in the null block.

        An executable's first call pays one-off costs (hundreds of ms for SmolLM2 on CPU) that
        belong to start-up, not to the first requests that happen to need that bucket. XLA:CPU
        also sets up the library calls inside the attention's KV loop on their first run, so the
        warm-up request attends to one position (all-padding inputs would skip the loop's body).
        An executable that serves several buckets runs once.
        """
        # In bucket order, not compile-completion order: every process of a multi-host engine must
        # run the same steps (collectives) in the same order.
        warmed = set()
        for bucket in sorted(self.compiled, key=self._bucket_index.__getitem__):
            compiled = self.compiled[bucket]
            if id(compiled) in warmed:
                continue
            warmed.add(id(compiled))
            inputs = self._host_inputs(bucket)
            inputs.attention.seq_lens[0] = 1  # block table and slot mapping stay 0: the null block
            inputs.attention.query_start_loc[1:] = 1
            self.kv_caches, self.penalty_state, result = compiled(self.weights, self.kv_caches, self.penalty_state, pack(inputs))
            result.block_until_ready()

    def peak_step_bytes(self) -> int:
        """Scratch memory of the largest decode and mixed steps, from XLA's own memory analysis.

        Pool sizing by gpu_memory_utilization sets this much aside besides the weights; it does
        not depend on the pool's size (the pool is donated and updated in place).
        """
        largest = [max((b for b in self.buckets if b.kind == kind), key=lambda b: b.num_tokens) for kind in ("decode", "mixed")]
        return max(self._lower(b).compile().memory_analysis().temp_size_in_bytes for b in largest)

    def lower_all(self, platform: str, backend: str) -> list[tuple[Bucket, Exception | None]]:
        """Lower every bucketed step for `platform` from shapes alone; the error of each that fails."""
        abstract = lambda tree: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
        weights, kv_caches, penalty_state = abstract(self.weights), abstract(self.kv_caches), abstract(self.penalty_state)
        results = []
        for bucket in self.buckets:
            try:
                self._step_fn(bucket, backend).trace(weights, kv_caches, penalty_state, self._packed_struct(bucket)).lower(
                    lowering_platforms=(platform,)
                )
                results.append((bucket, None))
            except Exception as error:  # noqa: BLE001 - reported per bucket by the CLI
                results.append((bucket, error))
        return results

    # ---- one step -------------------------------------------------------------

    def prepare(self, scheduled: SchedulerOutput) -> tuple[Bucket, StepInputs]:
        """Pick the bucket and fill its host buffers (numpy only: no device arrays, no compiles)."""
        rows = scheduled.scheduled
        num_prefills = sum(row.num_new_tokens > 1 for row in rows)
        if num_prefills > self.config.max_num_prefills:
            raise RuntimeError(
                f"the scheduler gave {num_prefills} prompt chunks in one step; the compiled steps hold at most "
                f"max_num_prefills={self.config.max_num_prefills} (a scheduler bug: report it)"
            )
        for request_id in scheduled.preempted_request_ids:  # they recompute from position 0
            self.penalty_slots.release(request_id)
        kind = "decode" if scheduled.is_decode_only else "mixed"
        bucket = pick_bucket(self.buckets, kind, scheduled.num_scheduled_tokens, len(rows))
        sampling_rows = [self._sampling_row(row.request) for row in rows if row.samples]
        inputs = self._host_inputs(bucket, sampling_rows)
        attn, bs = inputs.attention, self.block_size
        offset, num_sampling = 0, 0
        for i, row in enumerate(rows):
            request, start, n = row.request, row.start, row.num_new_tokens
            end = offset + n
            positions = np.arange(start, start + n, dtype=np.int32)
            blocks = np.asarray(request.block_ids, np.int32)
            inputs.token_ids[offset:end] = request.all_token_ids[start : start + n]
            inputs.positions[offset:end] = positions
            attn.slot_mapping[offset:end] = blocks[positions // bs] * bs + positions % bs
            attn.seq_lens[i] = start + n
            attn.block_tables[i, : len(blocks)] = blocks
            params, num_prompt = request.sampling_params, request.num_prompt_tokens
            if params.has_penalties:
                inputs.token_penalty_slots[offset:end] = self.penalty_slots.slot(request.request_id)
                inputs.token_prompt_lens[offset:end] = num_prompt
            if params.prompt_logprobs is not None and start + 1 < num_prompt:
                # the token at position p scores prompt token p + 1, across chunk boundaries too
                targets = request.prompt_token_ids[start + 1 : min(start + n, num_prompt - 1) + 1]
                inputs.prompt_logprob_targets[offset : offset + len(targets)] = targets
            offset = end
            attn.query_start_loc[i + 1] = offset
            if row.samples:  # sampling rows are compacted, in the order of sampling_rows
                inputs.logits_indices[num_sampling] = end - 1
                num_sampling += 1
        attn.query_start_loc[len(rows) + 1 :] = offset
        return bucket, inputs

    def _sampling_row(self, request: Any) -> SamplingRow:
        params = request.sampling_params
        suppress: list[int] = []
        if request.num_output_tokens < params.min_tokens:
            suppress = list(params.stop_token_ids or []) + ([] if params.ignore_eos else request.eos_token_ids)
        return SamplingRow(
            params=params,
            seed=request_seed(self.config.seed, request.request_id, params.seed),
            counter=request.num_output_tokens,
            suppress_token_ids=suppress,
            penalty_slot=self.penalty_slots.slot(request.request_id) if params.has_penalties else NO_SLOT,
        )

    def release_request(self, request_id: str) -> None:
        """The request finished or was aborted: free what the runner holds for it."""
        self.penalty_slots.release(request_id)

    def execute(
        self, scheduled: SchedulerOutput
    ) -> tuple[dict[str, SampledToken], dict[str, PromptLogprobsChunk]]:
        """Run one step: the sampled token of every request that samples in it, and the prompt
        logprobs scored in it for requests that asked for them."""
        bucket, inputs = self.prepare(scheduled)
        packed = pack(inputs)
        result = self.launch(bucket, packed)
        out: StepOutputs = unpack_host(np.asarray(result), self._out_layouts[bucket])
        sampled, logprobs = {}, out.sampled.logprobs
        for i, row in enumerate(r for r in scheduled.scheduled if r.samples):
            n = row.request.sampling_params.logprobs or 0
            sampled[row.request.request_id] = SampledToken(
                token_id=int(out.sampled.token_ids[i]),
                logprob=float(logprobs.logprobs[i]),
                rank=int(logprobs.ranks[i]),
                top_token_ids=logprobs.top_ids[i, :n].tolist(),
                top_logprobs=logprobs.top_logprobs[i, :n].tolist(),
            )
        return sampled, self._prompt_logprobs(scheduled, inputs, out.prompt)

    @staticmethod
    def _prompt_logprobs(
        scheduled: SchedulerOutput, inputs: StepInputs, prompt: TokenLogprobs
    ) -> dict[str, PromptLogprobsChunk]:
        chunks, offset = {}, 0
        for row in scheduled.scheduled:
            request, start = row.request, row.start
            num_prompt, n = request.num_prompt_tokens, request.sampling_params.prompt_logprobs
            if n is not None and start + 1 < num_prompt:
                rows = slice(offset, offset + min(row.num_new_tokens, num_prompt - 1 - start))
                chunks[request.request_id] = PromptLogprobsChunk(
                    start=start + 1,
                    token_ids=inputs.prompt_logprob_targets[rows].tolist(),
                    logprobs=prompt.logprobs[rows].tolist(),
                    ranks=prompt.ranks[rows].tolist(),
                    top_token_ids=prompt.top_ids[rows, :n].tolist(),
                    top_logprobs=prompt.top_logprobs[rows, :n].tolist(),
                )
            offset += row.num_new_tokens
        return chunks
