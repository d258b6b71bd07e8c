"""ModelRunner: buckets, input packing, precompilation and step dispatch.

Every step is one call of an executable compiled at start-up: the host packs
the step's metadata into one int32 buffer (one transfer in), the pool and the
penalty state are donated (updated in place), sampling runs inside the step, and
the sampled tokens, their logprobs and any prompt logprobs come back packed in
one buffer (one transfer out). The sampled tokens also stay on the device for the next
step: a token the host has not read yet (async scheduling) is taken from there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int
from tqdm.auto import tqdm

from cbjax.worker.block_table import BlockTable, TableWrites, apply_writes, empty_writes, gather_rows, write_capacity
from cbjax.worker.compilation.buckets import (
    ACCELERATOR_MIN_DECODE_REQS,
    CPU_MIN_DECODE_REQS,
    Bucket,
    compute_buckets,
    pick_bucket,
    step_shapes,
)
from cbjax.worker.compilation.compile_cache import StepCache, compile_cache_folder, step_compiler_options
from cbjax.worker.sample.logprobs import TokenLogprobs, prompt_logprobs
from cbjax.worker.distributed.multihost import peer_failures
from cbjax.worker.packing import PackedLayout, pack, pack_device, unpack, unpack_host
from cbjax.worker.sample.penalty_state import NO_SLOT, init_penalty_state, record_step_tokens
from cbjax.worker.persistent_batch import PreparedStep, follow, prepared_step, slots
from cbjax.worker.request_slots import RequestSlots
from cbjax.worker.sample import bad_words, grammar, min_tokens
from cbjax.worker.sample.sampler import (RequestColumns, SamplerOutput, SamplingRow, SamplingTensors,
                                        assemble_sampling_tensors, joining_request_columns, request_columns, sample)
from cbjax.core.outputs import PromptLogprobsChunk, SampledTokens
from cbjax.core.request import Request
from cbjax.core.structured.backend import bitmask_words
from cbjax.core.sched.output import SchedulerOutput
from cbjax.worker.sample.sharded import sample_vocab_sharded
from cbjax.worker.sample.verify import (DraftInputs, VerifiedTokens, empty_drafts, empty_verified, logits_with_drafts,
                                       verify_if_drafted)
from cbjax.worker.spec.draft_rows import draft_rows_needed, runs, write_draft_row
from cbjax.worker.distributed.sharding import TensorParallel, step_shardings
from cbjax.worker.weight_stacks import WeightStacks
from cbjax.worker.lora_slots import LoRASlotTable
from cbjax.models.layers.lora import set_token_slots
from cbjax.heap import release_free_heap
from cbjax.sampling_params import SamplingParams
from cbjax.models.layers.kv_pool import init_kv_pool
from kernels_cpu import kernel_problem, kernel_registered, registration_deferred
from cbjax.models.layers.attention import AttentionPlan, cpu_kernel_fallback
from kernels_pallas.lowering import lowering_mesh, lowering_target
from kernels_pallas.reference import AttentionMetadata

logger = logging.getLogger(__name__)

# Width of the per-row list of tokens forbidden while a request is under min_tokens (eos + stop ids).
SUPPRESS_LEN = min_tokens.SUPPRESS_LEN
# The sampling row of a request that failed as it joined: greedy, no stage (its token is never read).
_NEUTRAL_COLUMNS = request_columns(SamplingParams(temperature=0.0), 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """A step's AttentionMetadata as it travels: the block tables stay on the device (block_table.py),
    each row names its request's slot there instead."""

    slot_mapping: Int[Array, "tokens"]
    query_start_loc: Int[Array, "reqs_plus_1"]
    seq_lens: Int[Array, "reqs"]
    table_slots: Int[Array, "reqs"]  # the row's request slot; padding rows: the table's null row
    table_writes: TableWrites  # entries new since the step before, written before the step reads the table


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything a step reads besides the weights and the pool (numpy on host, arrays in the step)."""

    token_ids: Int[Array, "tokens"]
    # The previous step's sampling row whose token this is (not yet on the host), else -1.
    token_sources: Int[Array, "tokens"]
    positions: Int[Array, "tokens"]
    logits_indices: Int[Array, "reqs"]  # last new token of each sampling request, compacted
    attention: AttentionInputs
    sampling: SamplingTensors
    token_penalty_slots: Int[Array, "tokens"]  # the token's request's penalty slot, NO_SLOT without penalties
    token_prompt_lens: Int[Array, "tokens"]  # its request's prompt length (penalty rows only)
    prompt_logprob_targets: Int[Array, "tokens"]  # the next prompt token, where prompt_logprobs asked; else -1
    # with enable_lora: the token's request's LoRA slot (lora_slots.py), 0: no adapter
    lora_slots: Int[Array, "tokens"] | None = None
    drafts: DraftInputs | None = None  # with speculative decoding configured: the drafts to verify


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """What a step sends back, in one buffer."""

    sampled: SamplerOutput  # per sampling row
    prompt: TokenLogprobs  # per token row: the logprob of prompt_logprob_targets
    verified: VerifiedTokens | None = None  # per draft row (StepInputs.drafts)


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step started on the device; its packed result may still be being computed."""

    scheduled: SchedulerOutput
    bucket: Bucket
    inputs: StepInputs
    sampling_requests: tuple[Any, ...]  # the scheduled requests that sample, in row order
    result: jax.Array
    scores_prompt: bool = True  # False: no row scores prompt tokens (its result has none to read)
    wants_logprobs: bool = True  # False: no row asked for its sampled token's logprobs


# vLLM's fp8 names: e4m3 without infinities (OCP's "fn"), whose 448 bounds every saturated write.
FP8_KV_CACHE_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}


def kv_cache_dtype(requested: str, model: nnx.Module) -> jnp.dtype:
    """The pool's dtype: the model's activation dtype, unless the user asked for another."""
    if requested == "auto":
        return model.activation_dtype
    return jnp.dtype(FP8_KV_CACHE_DTYPES.get(requested, requested))


def matmul_precision(activation_dtype: Any, platform: str) -> str | None:
    """"highest" where float32 activations would otherwise get float32 dots of lower precision.

    XLA on NVIDIA GPUs computes float32 dots with TF32 by default (10-bit mantissa inputs), which
    moves float32 logits by about 1e-3 and changes greedy outputs; PyTorch, and so vLLM, keep
    float32 matmuls in full float32 unless asked. On CPUs float32 dots are already full precision,
    and 16-bit activations gain nothing, so the default stays there.
    """
    return "highest" if platform != "cpu" and jnp.dtype(activation_dtype) == jnp.float32 else None


def request_seed(engine_seed: int, request_id: str, seed: int | None) -> int:
    """A request's own seed, or one derived from the engine seed and its id (stable across runs)."""
    if seed is not None:
        return seed & 0x7FFFFFFF
    return zlib.crc32(f"{engine_seed}:{request_id}".encode()) & 0x7FFFFFFF


class ModelRunner:
    """Owns the weights, the KV pool and the compiled steps."""

    # The most eos and stop token ids a row holds back under min_tokens (EngineCore checks each request against it).
    max_suppressed_ids = SUPPRESS_LEN

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
        # Speculative decoding: mixed steps verify up to this many requests' drafts (0: off), k each.
        self.num_draft_rows = draft_rows_needed(config)
        self.num_speculative_tokens = config.speculative_config.num_speculative_tokens if self.num_draft_rows else 0
        self.graphdef, state = nnx.split(model)
        init_pool = functools.partial(
            init_kv_pool, model_config, num_blocks, config.block_size, kv_cache_dtype(config.kv_cache_dtype, model)
        )
        self.weights, self._state_treedef, self.kv_pool, self.penalty_state = self._device_state(state, init_pool)
        # What a step's call takes of them: the same arrays, the vectors alike stacked (weight_stacks.py).
        self.weight_stacks = WeightStacks.of(self.weights)
        self.step_weights = self.weight_stacks.stack(self.weights)
        # LoRA adapters' device slots (enable_lora; the model has its slots from attach_lora): lora_slots.py
        self.lora = (LoRASlotTable(model, self.weight_stacks, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
                     if config.enable_lora else None)
        self.slots = RequestSlots(config.max_num_seqs)  # each running request's row in the table and penalty state
        self.table = BlockTable(config.max_num_seqs, self.max_blocks_per_seq)
        self.block_table = self._replicated_zeros(self.table.mirror.shape)  # the device's table (block_table.py)
        self._shardings = {} if tensor_parallel is None else step_shardings(tensor_parallel, self.step_weights)
        self.buckets = compute_buckets(
            config.max_num_seqs, config.max_num_batched_tokens, midpoints=config.prompt_bucket_midpoints,
            verify_rows=self.num_draft_rows, num_speculative_tokens=self.num_speculative_tokens,
            min_decode_reqs=CPU_MIN_DECODE_REQS if backend == "cpp" else ACCELERATOR_MIN_DECODE_REQS)
        # Table writes beyond a step's own capacity go first, this many per call of the write_table program.
        self.table_write_size = max(self._write_capacity(bucket) for bucket in self.buckets)
        # The latest step's sampled tokens, kept on the device (padded to the widest bucket): the next
        # step reads from there the tokens the host lacks (each request's row: the PreparedStep's).
        self.last_sampled = self._replicated_zeros((max(b.num_reqs for b in self.buckets),))
        # The latest prepared step: a decode step over the same rows, one position on, follows it
        # (persistent_batch.py) instead of being built row by row. Off: every step row by row.
        self._prepared: PreparedStep | None = None
        self.follow_decode_steps = True
        # Each running request's sampling columns that do not change (sampler.request_columns; its seed
        # derived once, by request_seed): made when it first gets its slot, dropped with the slot.
        self.sampling_constants: dict[str, tuple] = {}
        # (request id, why) of requests whose rows could not be written: the core finishes each alone.
        self.failed_requests: list[tuple[str, str]] = []
        # The constrained rows' token masks of the step prepare() built last (None: no row is
        # constrained), and the all-zero masks a step without one is given, by row count.
        self.step_grammar_bitmask: np.ndarray | None = None
        self._unused_masks: dict[int, jax.Array] = {}
        self.compiled: dict[Bucket, Any] = {}
        self._write_table: Any = None  # the compiled write_table program (precompile)
        self._warned_on_demand = False  # a step compiled while serving stalls it: say so, once
        # Where each field of a step's packed inputs and packed result lies, per bucket (a stand-in
        # device, cbjax/bench/standin_device.py, reads and writes them too).
        self.input_layouts = {bucket: PackedLayout.of(self._host_inputs(bucket)) for bucket in self.buckets}
        self.output_layouts = {bucket: PackedLayout.of(self._host_outputs(bucket)) for bucket in self.buckets}
        self._bucket_index = {bucket: i for i, bucket in enumerate(self.buckets)}
        self.step_broadcast: Any = None  # multi-host leader: sends each step to the workers (worker/distributed/multihost.py)
        self.activation_dtype = model.activation_dtype
        self.matmul_precision = matmul_precision(model.activation_dtype, jax.devices()[0].platform)
        self.compiler_options = step_compiler_options(jax.devices()[0].platform)
        # Whole compiled steps, keyed without tracing (one device only: sharded steps go through JAX's cache alone).
        folder = compile_cache_folder(config.compilation_cache_dir, jax.devices()[0])
        single_device = tensor_parallel is None and getattr(config, "num_processes", 1) == 1
        self.step_cache = (StepCache(folder, next(iter(self.kv_pool[0].devices())))  # stored steps run where the pool is
                           if folder is not None and single_device else None)

    def _device_state(self, state: nnx.State, init_pool: Any) -> tuple[list[jax.Array], Any, Any, Any]:
        """The weights as a flat list (and their treedef), the KV pool and the penalty state, on the devices."""
        tensor_parallel = self.tensor_parallel
        if tensor_parallel is not None:
            state = tensor_parallel.shard_state(state)
        # The weights travel as a flat list: flattening nnx's State pytree on every call cost
        # about 4 ms of dispatch per step.
        weights, treedef = jax.tree_util.tree_flatten(state)
        # Under TP each device allocates only its own KV heads.
        kv_pool = init_pool() if tensor_parallel is None else jax.jit(init_pool, out_shardings=tensor_parallel.pool_sharding)()
        penalty_state = init_penalty_state(self.config.max_num_seqs, self.model_config.vocab_size)
        if tensor_parallel is not None:  # the sampler reads whole vocabulary rows on every device
            penalty_state = jax.device_put(penalty_state, tensor_parallel.replicated)
        return weights, treedef, kv_pool, penalty_state

    def _replicated_zeros(self, shape: tuple[int, ...]) -> jax.Array:
        """An int32 device buffer of the runner's own state (whole on every device under TP)."""
        buffer = jnp.zeros(shape, jnp.int32)
        return buffer if self.tensor_parallel is None else jax.device_put(buffer, self.tensor_parallel.replicated)

    def _write_capacity(self, bucket: Bucket) -> int:
        return write_capacity(bucket.num_tokens, bucket.num_reqs, self.block_size)

    # ---- shapes -------------------------------------------------------------

    def _host_inputs(self, bucket: Bucket, sampling: SamplingTensors | None = None) -> StepInputs:
        """Host buffers of one bucket, zeroed: padded rows attend to nothing and write to the null block."""
        num_tokens, num_reqs = bucket.num_tokens, bucket.num_reqs
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return StepInputs(
            token_ids=zeros(num_tokens),
            token_sources=np.full(num_tokens, -1, np.int32),
            positions=zeros(num_tokens),
            logits_indices=zeros(num_reqs),
            attention=AttentionInputs(
                slot_mapping=zeros(num_tokens),
                query_start_loc=zeros(num_reqs + 1),
                seq_lens=zeros(num_reqs),
                table_slots=np.full(num_reqs, self.table.null_slot, np.int32),
                table_writes=empty_writes(self._write_capacity(bucket), self.table.null_slot),
            ),
            sampling=assemble_sampling_tensors([], [], {}, num_reqs, SUPPRESS_LEN) if sampling is None else sampling,
            token_penalty_slots=np.full(num_tokens, NO_SLOT, np.int32),
            token_prompt_lens=zeros(num_tokens),
            prompt_logprob_targets=np.full(num_tokens, -1, np.int32),
            lora_slots=zeros(num_tokens) if self.lora is not None else None,
            drafts=empty_drafts(self._draft_rows(bucket), self.num_speculative_tokens) if self.num_draft_rows else None,
        )

    def _host_outputs(self, bucket: Bucket) -> StepOutputs:
        def logprobs(num_rows: int) -> TokenLogprobs:
            k = self.config.max_logprobs
            return TokenLogprobs(np.zeros(num_rows, np.float32), np.zeros(num_rows, np.int32),
                                 np.zeros((num_rows, k), np.int32), np.zeros((num_rows, k), np.float32))

        # Every step carries the draft rows where speculation is configured, though only mixed steps verify: a
        # decode and a mixed bucket of one shape then still share their executable (step_shapes).
        verified = empty_verified(self._draft_rows(bucket), self.num_speculative_tokens) if self.num_draft_rows else None
        return StepOutputs(SamplerOutput(np.zeros(bucket.num_reqs, np.int32), logprobs(bucket.num_reqs)),
                           logprobs(bucket.num_tokens), verified)

    def _draft_rows(self, bucket: Bucket) -> int:
        """Draft rows of `bucket`'s steps: no more requests than can verify one draft each in it."""
        return min(self.num_draft_rows, bucket.num_reqs, bucket.num_tokens // 2)

    # ---- the step -----------------------------------------------------------

    def _step_fn(self, bucket: Bucket, backend: str, name: str = "step"):
        graphdef, layout, num_logprobs = self.graphdef, self.input_layouts[bucket], self.config.max_logprobs
        state_treedef, weight_stacks = self._state_treedef, self.weight_stacks
        mesh = None if self.tensor_parallel is None else self.tensor_parallel.mesh
        lora = self.lora is not None

        def step(step_weights, kv_pool, penalty_state, last_sampled, block_table, packed, grammar_bitmask):
            inputs: StepInputs = unpack(packed, layout)
            token_ids = jnp.where(
                inputs.token_sources >= 0, last_sampled[jnp.maximum(inputs.token_sources, 0)], inputs.token_ids
            )
            attn = inputs.attention
            block_table = apply_writes(block_table, attn.table_writes)
            metadata = AttentionMetadata(
                attn.slot_mapping, attn.query_start_loc, attn.seq_lens,
                gather_rows(block_table, attn.table_slots, attn.seq_lens, self.block_size),
            )
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, weight_stacks.unstack(step_weights)))
            if lora:
                set_token_slots(model, inputs.lora_slots)
            plan = AttentionPlan(backend, bucket.kind == "decode", self.config.max_num_prefills, mesh,
                                 self.config.enable_expert_parallel)
            hidden, kv_pool = model.hidden_states(token_ids, inputs.positions, kv_pool, metadata, plan)
            compute_logits = functools.partial(model.compute_logits, plan=plan)
            if inputs.drafts is None:
                logits, draft_logits = compute_logits(hidden[inputs.logits_indices]), None
            else:
                logits, draft_logits = logits_with_drafts(compute_logits, hidden, inputs.logits_indices, inputs.drafts)
            logits = grammar.masked(logits, inputs.sampling, grammar_bitmask)
            penalty_state = record_step_tokens(penalty_state, token_ids, inputs.positions,
                                               inputs.token_penalty_slots, inputs.token_prompt_lens)
            # each sampling row's last input token is its newest output token, maybe not on the host yet
            sampling = bad_words.with_newest_output_tokens(inputs.sampling, token_ids[inputs.logits_indices])
            if mesh is None:
                sampled = sample(logits, sampling, penalty_state, num_logprobs)
            else:  # logits split by vocabulary: sample from each device's top candidates where that is exact
                sampled = sample_vocab_sharded(logits, sampling, penalty_state, num_logprobs, mesh)
            outputs = StepOutputs(
                sampled,
                prompt_logprobs(compute_logits, hidden, inputs.prompt_logprob_targets, num_logprobs),
                None if inputs.drafts is None else
                verify_if_drafted(draft_logits, inputs.drafts, sampling, penalty_state),
            )
            last_sampled = jnp.zeros_like(last_sampled).at[: bucket.num_reqs].set(outputs.sampled.token_ids)
            return kv_pool, penalty_state, last_sampled, block_table, pack_device(outputs)

        step.__name__ = step.__qualname__ = name  # the program's name, part of JAX's persistent cache key
        return jax.jit(step, donate_argnums=(1, 2, 3, 4), **self._shardings)

    def _write_table_fn(self):
        """The program that writes table entries a step had no room for (block_table.py), before that step."""
        layout = self._write_table_layout

        def write_table(block_table, packed):
            return apply_writes(block_table, unpack(packed, layout))

        shardings = {}
        if self.tensor_parallel is not None:
            replicated = self.tensor_parallel.replicated
            shardings = {"in_shardings": (replicated, replicated), "out_shardings": replicated}
        return jax.jit(write_table, donate_argnums=(0,), **shardings)

    def _spill_writes(self) -> TableWrites:
        """Empty host buffers of one write_table call (table_write_size entries)."""
        return empty_writes(self.table_write_size, self.table.null_slot)

    @functools.cached_property
    def _write_table_layout(self) -> PackedLayout:
        return PackedLayout.of(self._spill_writes())

    def _packed_struct(self, bucket: Bucket) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.packed_size(bucket),), jnp.int32)

    def _masks_struct(self, bucket: Bucket) -> jax.ShapeDtypeStruct:
        """A step's token masks: a row per sampling row, 32 tokens a word (sample/grammar.py)."""
        return jax.ShapeDtypeStruct((bucket.num_reqs, bitmask_words(self.model_config.vocab_size)), jnp.int32)

    def _no_masks(self, bucket: Bucket) -> jax.Array:
        """The masks of a step without a constrained row, kept on the device: such a step sends none."""
        masks = self._unused_masks.get(bucket.num_reqs)
        if masks is None:
            masks = self._unused_masks[bucket.num_reqs] = self._replicated_zeros(self._masks_struct(bucket).shape)
        return masks

    def packed_size(self, bucket: Bucket) -> int:
        return self.input_layouts[bucket].size

    def launch(self, bucket: Bucket, packed: Int[np.ndarray, "size"],
               grammar_bitmask: Int[np.ndarray, "reqs words"] | None = None) -> jax.Array:
        """Start one step on the packed inputs (and the constrained rows' token masks, if any row is:
        sample/grammar.py); its packed result (fully replicated, so any process reads it).

        The one place a step is launched: a multi-host leader first sends the step to the workers,
        which then launch the same step on their own devices.
        """
        if self.step_broadcast is not None:
            self.step_broadcast.send_step(self._bucket_index[bucket], packed)
        self.kv_pool, self.penalty_state, self.last_sampled, self.block_table, result = self._executable(bucket)(
            self.step_weights, self.kv_pool, self.penalty_state, self.last_sampled, self.block_table, packed,
            self._no_masks(bucket) if grammar_bitmask is None else grammar_bitmask,
        )
        return result

    @property
    def write_table_packed_size(self) -> int:
        return self._write_table_layout.size

    @property
    def write_table_index(self) -> int:
        """The write_table program's index in a multi-host step broadcast (the buckets come first)."""
        return len(self.buckets)

    def write_table(self, packed: Int[np.ndarray, "size"]) -> None:
        """Write table entries (block_table.py; packed TableWrites of table_write_size entries) into the
        device's table; a multi-host leader first sends them to the workers, as launch does a step."""
        if self.step_broadcast is not None:
            self.step_broadcast.send_step(self.write_table_index, packed)
        self.block_table = self._table_writer()(self.block_table, packed)

    def _table_writer(self) -> Any:
        """The compiled write_table program (compiled by precompile; tiny, so compiled here otherwise)."""
        if self._write_table is None:
            packed = jax.ShapeDtypeStruct((self.write_table_packed_size,), jnp.int32)
            self._write_table = self._write_table_fn().lower(self.block_table, packed).compile()
        return self._write_table

    def precompile(self, progress: bool = True, buckets: list[Bucket] | None = None) -> None:
        """Compile every bucket now (or only `buckets`, for a caller that knows its steps), so that
        serving never compiles.

        XLA compiles outside the GIL, so buckets compile on all cores at once, while the next ones
        are traced. They are traced one after another: tracing in parallel threads made the HLO
        differ from run to run (a constant shared by the layers was sometimes built twice), so the
        persistent compilation cache missed. Buckets that lower to the same program share one executable.
        """
        buckets = self.buckets if buckets is None else buckets
        logger.info("step buckets (kind, tokens, requests): %s", [(b.kind, b.num_tokens, b.num_reqs) for b in buckets])
        shapes = self._step_shapes(buckets)
        programs = list(dict.fromkeys(shapes.values()))
        keys = {shape: self._step_key(shape) for shape in programs} if self.step_cache is not None else {}
        stored = {shape: key for shape, key in keys.items() if self.step_cache.has(key)}
        if stored and not self._kernel_ready():  # a stored step calls the kernel's targets by name
            return self.precompile(progress, buckets)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            loaded = dict(zip(stored, pool.map(self.step_cache.load, stored.values()))) if stored else {}
            executables = {shape: executable for shape, executable in loaded.items() if executable is not None}
            # Traced one after another while the C++ kernel may still be building (register_in_background);
            # each compiles on the pool as soon as it is traced and the kernel is registered.
            lowered: dict[Bucket, jax.stages.Lowered] = {}
            futures: dict[concurrent.futures.Future, Bucket] = {}

            def submit_traced() -> None:
                for shape in [shape for shape in lowered if shape not in futures.values()]:
                    futures[pool.submit(StepCache.compile_fresh, lowered[shape], self.compiler_options)] = shape

            for shape in programs:
                if shape not in executables:
                    lowered[shape] = self._lower(shape, wait_for_kernel=False)
                    if self.backend != "cpp" or kernel_registered():
                        submit_traced()
            if lowered and not self._kernel_ready():
                return self.precompile(progress, buckets)
            submit_traced()
            done = concurrent.futures.as_completed(futures)
            for future in tqdm(done, total=len(futures), desc="compiling steps", disable=not progress or not futures):
                shape = futures[future]
                executables[shape], fresh = future.result()
                if fresh and shape in keys:
                    self.step_cache.store(keys[shape], executables[shape])
                # Each compile leaves tens of MB freed in its thread's malloc arena, ~470 MB for a
                # cold SmolLM2 start: hand it back as it comes, or it sits under the warm-up's peak.
                release_free_heap()
        for bucket, shape in shapes.items():
            self.compiled[bucket] = executables[shape]
        self._table_writer()
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
            self.graphdef, self._state_treedef, avals(self.step_weights), self.weight_stacks, avals(self.kv_pool), avals(self.penalty_state),
            avals(self.last_sampled), avals(self.block_table), self.matmul_precision, sorted(self.compiler_options.items()), self.backend, StepCache.kernel_build(self.backend), sorted(options.items()),
        ))

    def _step_key(self, bucket: Bucket) -> str:
        """The StepCache key of `bucket`'s program: everything it is traced from besides the code."""
        return StepCache.key((self._step_key_base, self.input_layouts[bucket], self.output_layouts[bucket], bucket))

    def _compile(self, bucket: Bucket) -> Any:
        """Trace, lower and compile `bucket`'s step with this device's compiler options (no cache)."""
        return self._lower(bucket).compile(compiler_options=self.compiler_options or None)

    def _lower(self, bucket: Bucket, wait_for_kernel: bool = True) -> jax.stages.Lowered:
        """`bucket`'s step, traced and lowered. wait_for_kernel=False: without waiting for the C++
        kernel's build; then call _kernel_ready() before compiling the result."""
        if wait_for_kernel:
            self._kernel_ready()
        deferred = registration_deferred() if self.backend == "cpp" else contextlib.nullcontext()
        # A step the step cache stores is named after its key there, so JAX's persistent cache (keyed
        # by the program, name included) never hands it an executable compiled under another key:
        # for other engine options or older code that traced to the same program. Such an executable
        # cannot be stored (StepCache.compile_fresh), and every later start would trace again.
        name = "step" if self.step_cache is None else f"step_{self._step_key(bucket)}"
        with jax.default_matmul_precision(self.matmul_precision), deferred:  # the precision is read by every dot
            return self._step_fn(bucket, self.backend, name).lower(
                self.step_weights, self.kv_pool, self.penalty_state, self.last_sampled, self.block_table,
                self._packed_struct(bucket), self._masks_struct(bucket),
            )

    def _kernel_ready(self) -> bool:
        """Wait for the C++ kernel's build and registration (a no-op for other backends, or once done).

        False if the build failed: the runner then serves with the jnp attention ("xla", with
        cpu_kernel_fallback's warning), and steps traced before are stale.
        """
        if self.backend != "cpp":
            return True
        problem = kernel_problem()
        if problem is None:
            return True
        self.backend = cpu_kernel_fallback(self.config.attention_backend, problem)
        self.__dict__.pop("_step_key_base", None)  # it names the backend
        return False

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
            compiled = self._compile(bucket)
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
            inputs.attention.seq_lens[0] = 1  # the table's null row and slot mapping 0: the null block
            inputs.attention.query_start_loc[1:] = 1
            self.kv_pool, self.penalty_state, self.last_sampled, self.block_table, result = compiled(
                self.step_weights, self.kv_pool, self.penalty_state, self.last_sampled, self.block_table, pack(inputs),
                self._no_masks(bucket),
            )
            result.block_until_ready()
        self.block_table = self._table_writer()(self.block_table, pack(self._spill_writes()))
        self._prepared = None  # last_sampled now holds the warm-up's tokens: no step follows from it

    def peak_step_bytes(self) -> int:
        """Scratch memory of the largest decode and mixed steps, from XLA's own memory analysis.

        Pool sizing by gpu_memory_utilization sets this much aside besides the weights; it hardly
        depends on the pool's size (the pool is donated and updated in place; on an H200 the 2-block
        probe's was about 5% the larger). Stored in the step cache under the two steps' keys, so a
        warm start does not trace them again.
        """
        largest = [max((b for b in self.buckets if b.kind == kind), key=lambda b: b.num_tokens) for kind in ("decode", "mixed")]
        key = None if self.step_cache is None else StepCache.key(("peak_step_bytes", *map(self._step_key, largest)))
        stored = None if key is None else self.step_cache.recall_number(key)
        if stored is not None:
            return stored
        peak = max(self._compile(b).memory_analysis().temp_size_in_bytes for b in largest)
        if key is not None:
            self.step_cache.remember_number(key, peak)
        return peak

    def lower_for(self, bucket: Bucket, platform: str, backend: str) -> jax.stages.Lowered:
        """The step of `bucket` lowered for `platform` from shapes alone (its shardings come from the jit)."""
        abstract = lambda tree: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
        # Under TP the step carries its own mesh, which an abstract target would contradict: it is
        # traced on the same axes over the target GPU instead (lowering_mesh) where that is needed.
        target = lowering_target(platform) if self.tensor_parallel is None else contextlib.nullcontext()
        mesh = None if self.tensor_parallel is None else lowering_mesh(platform, self.tensor_parallel.mesh)
        with jax.default_matmul_precision(matmul_precision(self.activation_dtype, platform)), target, self._on_mesh(mesh):
            return self._step_fn(bucket, backend).trace(
                *abstract((self.step_weights, self.kv_pool, self.penalty_state, self.last_sampled, self.block_table)),
                self._packed_struct(bucket), self._masks_struct(bucket),
            ).lower(lowering_platforms=(platform,))

    @contextlib.contextmanager
    def _on_mesh(self, mesh: jax.sharding.AbstractMesh | None) -> Iterator[None]:
        """Steps built inside see the tensor-parallel mesh replaced by `mesh` (same axes), their
        shardings too; nothing changes with None."""
        if mesh is None:
            yield
            return
        saved = self.tensor_parallel, self._shardings
        self.tensor_parallel = dataclasses.replace(self.tensor_parallel, mesh=mesh)
        self._shardings = jax.tree_util.tree_map(lambda s: jax.sharding.NamedSharding(mesh, s.spec), self._shardings,
                                                 is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding))
        try:
            yield
        finally:
            self.tensor_parallel, self._shardings = saved

    def lower_all(self, platform: str, backend: str) -> list[tuple[Bucket, Exception | None]]:
        """Lower every bucketed step for `platform` from shapes alone; the error of each that fails."""
        results = []
        for bucket in self.buckets:
            try:
                self.lower_for(bucket, platform, backend)
                results.append((bucket, None))
            except Exception as error:  # noqa: BLE001 - reported per bucket by the CLI
                results.append((bucket, error))
        return results

    # ---- one step -------------------------------------------------------------

    def prepare(self, scheduled: SchedulerOutput) -> tuple[Bucket, StepInputs]:
        """Pick the bucket and fill its host buffers (numpy only: no device arrays, no compiles)."""
        rows = scheduled.scheduled
        num_prefills = 0 if scheduled.is_decode_only else sum(row.num_new_tokens > 1 for row in rows)
        if num_prefills > self.config.max_num_prefills:
            raise RuntimeError(
                f"the scheduler gave {num_prefills} prompt chunks in one step; the compiled steps hold at most "
                f"max_num_prefills={self.config.max_num_prefills} (a scheduler bug: report it)"
            )
        for request_id in scheduled.preempted_request_ids:  # they recompute from position 0, blocks anew
            self._release_slot(request_id)
        self.step_grammar_bitmask = None  # (a step that follows the previous one has no constrained row)
        kind = "decode" if scheduled.is_decode_only else "mixed"
        bucket = pick_bucket(self.buckets, kind, scheduled.num_scheduled_tokens, len(rows))
        previous = self._prepared
        followed = (follow(previous, bucket, scheduled, self.table, self.block_size, self._host_inputs, self.slots.slot)
                    if self.follow_decode_steps else None)
        if followed is not None:
            inputs, self._prepared = followed
            return bucket, inputs
        # Per row only what differs in length (tokens, block ids) and what each sampling row needs;
        # the rest as whole columns.
        bs, num_rows = self.block_size, len(rows)
        starts = np.fromiter((row.start for row in rows), np.int32, num_rows)
        counts = np.fromiter((row.num_new_tokens for row in rows), np.int32, num_rows)
        ends = np.cumsum(counts, dtype=np.int32)  # where each row's tokens end among the token rows
        num_tokens = int(ends[-1])
        row_of_token = np.repeat(np.arange(num_rows), counts)
        positions = np.arange(num_tokens, dtype=np.int32) + np.repeat(starts - (ends - counts), counts)
        token_ids: list[int] = []
        placeholders, sources = [], []  # token rows taken on the device, and from which sampling row
        row_slots, row_penalty_slots, row_prompt_lens = [0] * num_rows, [NO_SLOT] * num_rows, [0] * num_rows
        logprob_targets = []
        sampling_rows, constants, counters, step_rows = [], [], [], {}  # per sampling row
        constrained = []  # (sampling row, its request's grammar)
        spec_token_ids = scheduled.spec_token_ids
        draft_rows = []  # (sampling row, token row of its newest token, drafts)
        # Each request's sampling row in the previous step, whose token a row may take on the device.
        last_sampling_rows = {} if previous is None else {r.request_id: k for k, r in enumerate(previous.sampling_requests)}
        for i, row in enumerate(rows):
            request, start, n, offset = row.request, row.start, row.num_new_tokens, len(token_ids)
            request_id = request.request_id
            row_slots[i] = slot = self.slots.slot(request_id)
            self.table.sync(slot, request.block_ids)
            known = request.all_token_ids[start : start + n]
            token_ids += known
            drafts = spec_token_ids.get(request_id) if spec_token_ids else None
            if drafts:  # its newest token, then its drafts
                draft_rows.append((len(constants), offset, drafts))
                token_ids += drafts
            elif len(known) < n:  # the token the previous step samples: taken from its output on the device
                placeholders.append(len(token_ids))
                sources.append(last_sampling_rows[request_id])
                token_ids.append(0)
            params, num_prompt = request.sampling_params, request.num_prompt_tokens
            if params.has_penalties:
                row_penalty_slots[i], row_prompt_lens[i] = slot, num_prompt
            if params.prompt_logprobs is not None and start + 1 < num_prompt:
                # the token at position p scores prompt token p + 1, across chunk boundaries too
                logprob_targets.append((offset, request.prompt_token_ids[start + 1 : min(start + n, num_prompt - 1) + 1]))
            if row.samples:
                columns = self.sampling_constants.get(request_id)
                if columns is None:
                    columns = self.sampling_constants[request_id] = self._join(request, slot)
                # The index of the token sampled now: the scheduler already counts it as a placeholder.
                output_index = request.num_output_tokens + request.num_output_placeholders - 1
                if columns.per_step:  # min_tokens, bad_words: columns that change every step
                    step_rows[len(constants)] = SamplingRow(
                        params, 0, output_index, min_tokens.suppressed_ids(params, output_index, request.eos_token_ids),
                        output_token_ids=request.output_token_ids)
                if request.grammar is not None:
                    constrained.append((len(constants), request.grammar))
                sampling_rows.append(request)
                constants.append(columns)
                counters.append(output_index)
        inputs = self._host_inputs(bucket, assemble_sampling_tensors(constants, counters, step_rows, bucket.num_reqs, SUPPRESS_LEN))
        if constrained:
            self.step_grammar_bitmask = np.zeros(self._masks_struct(bucket).shape, np.int32)
        for k, row_grammar in constrained:  # the tokens its grammar allows next
            row_grammar.fill_bitmask(self.step_grammar_bitmask, k)
        for index, (sampling_row, first_token_row, drafts) in enumerate(draft_rows):
            write_draft_row(inputs.drafts, index, sampling_row, first_token_row, drafts)
        attn = inputs.attention
        for offset, targets in logprob_targets:
            inputs.prompt_logprob_targets[offset : offset + len(targets)] = targets
        inputs.token_ids[:num_tokens] = token_ids
        inputs.token_sources[placeholders] = sources
        inputs.token_penalty_slots[:num_tokens] = np.repeat(row_penalty_slots, counts)
        inputs.token_prompt_lens[:num_tokens] = np.repeat(row_prompt_lens, counts)
        inputs.positions[:num_tokens] = positions
        if self.lora is not None:
            inputs.lora_slots[:num_tokens] = np.repeat(self.lora.step_slots([row.request.lora_request for row in rows]), counts)
        attn.table_slots[:num_rows] = row_slots
        self.table.take_writes(attn.table_writes)
        attn.slot_mapping[:num_tokens] = slots(self.table.mirror, attn.table_slots[row_of_token], positions, bs)
        attn.seq_lens[:num_rows] = starts + counts
        attn.query_start_loc[1 : num_rows + 1] = ends
        attn.query_start_loc[num_rows + 1 :] = num_tokens
        samples = np.fromiter((row.samples for row in rows), bool, num_rows)
        inputs.logits_indices[: len(sampling_rows)] = ends[samples] - 1  # compacted, as sampling_rows
        self._prepared = prepared_step(bucket, scheduled, inputs, starts, sampling_rows, bool(logprob_targets))
        return bucket, inputs

    def _join(self, request: Request, slot: int) -> RequestColumns:
        """A request's constant sampling columns, made when it first samples. One whose values the
        columns cannot hold fails alone: its row samples as a neutral greedy row this step, and the
        core finishes it with the error (failed_requests) while the others carry on."""
        params = request.sampling_params
        try:
            seed = request_seed(self.config.seed, request.request_id, params.seed)
            return joining_request_columns(params, seed, slot if params.has_penalties else NO_SLOT, request.eos_token_ids)
        except Exception as error:  # noqa: BLE001 (whatever one request's values raise is that request's error)
            logger.warning("request %s failed as it joined the batch: %r", request.request_id, error)
            self.failed_requests.append((request.request_id, f"the engine could not prepare this request: its "
                                         f"sampling parameters do not fit the sampler ({error!r})"))
            return _NEUTRAL_COLUMNS

    def add_lora(self, lora_request: Any) -> None:
        """Read and check a LoRA adapter (cbjax.lora.LoRARequest) onto the host; ValueError if it is bad."""
        if self.lora is None:
            raise ValueError(f"request names LoRA adapter {lora_request.lora_name!r} but the engine was started "
                             "without enable_lora; start it with enable_lora=True (cbjax serve --enable-lora)")
        self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter on the host; False if none has that id."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def release_request(self, request_id: str) -> None:
        """The request finished or was aborted: free what the runner holds for it."""
        self._release_slot(request_id)

    def _release_slot(self, request_id: str) -> None:
        slot = self.slots.release(request_id)
        if slot is not None:
            self.table.forget(slot)
        self.sampling_constants.pop(request_id, None)  # they name the penalty slot

    def execute(self, scheduled: SchedulerOutput) -> tuple[SampledTokens, dict[str, PromptLogprobsChunk]]:
        """Run one step and wait for it (see `collect`)."""
        return self.collect(self.dispatch(scheduled))

    def dispatch(self, scheduled: SchedulerOutput) -> LaunchedStep:
        """Start one step without waiting for it."""
        bucket, inputs = self.prepare(scheduled)
        with peer_failures(self.step_broadcast):  # multi-host: a dead peer fails the step's collectives
            while self.table.num_queued:  # entries the step had no room for (block_table.py): written first
                writes = self._spill_writes()
                self.table.take_writes(writes)
                self.write_table(pack(writes))
            if self.lora is not None:  # adapters this step made resident: their slots' arrays
                self.lora.put(self.step_weights)
            result = self.launch(bucket, pack(inputs), self.step_grammar_bitmask)
        result.copy_to_host_async()  # the read-back starts as soon as the step ends
        prepared = self._prepared
        return LaunchedStep(scheduled, bucket, inputs, prepared.sampling_requests, result, prepared.scores_prompt,
                            prepared.wants_logprobs)

    def collect(self, launched: LaunchedStep) -> tuple[SampledTokens, dict[str, PromptLogprobsChunk]]:
        """Wait for a launched step: the sampled token of every request that samples in it, and the
        prompt logprobs scored in it for requests that asked for them."""
        scheduled, inputs = launched.scheduled, launched.inputs
        with peer_failures(self.step_broadcast):
            result = np.asarray(launched.result)
        out: StepOutputs = unpack_host(result, self.output_layouts[launched.bucket])
        logprobs = out.sampled.logprobs
        rows = launched.sampling_requests
        # Whole columns to Python at once: per-row numpy indexing cost microseconds a row.
        token_ids, token_logprobs, ranks = (column[: len(rows)].tolist() for column in
                                            (out.sampled.token_ids, logprobs.logprobs, logprobs.ranks))
        top = {}
        asked = np.flatnonzero(inputs.sampling.wants_logprobs[: len(rows)]).tolist() if launched.wants_logprobs else ()
        for i in asked:  # rows that asked for them
            n = rows[i].sampling_params.logprobs
            top[i] = (logprobs.top_ids[i, :n].tolist(), logprobs.top_logprobs[i, :n].tolist())
        verified_runs = {}
        if scheduled.spec_token_ids:  # a verifying row's run: its token is the run's last
            verified_runs = runs(inputs.drafts, out.verified, len(scheduled.spec_token_ids))
            for row, run in verified_runs.items():
                token_ids[row] = run[-1]
        sampled = SampledTokens(rows, token_ids, token_logprobs, ranks, top, verified_runs)
        return sampled, self._prompt_logprobs(scheduled, inputs, out.prompt) if launched.scores_prompt else {}

    @staticmethod
    def _prompt_logprobs(
        scheduled: SchedulerOutput, inputs: StepInputs, prompt: TokenLogprobs
    ) -> dict[str, PromptLogprobsChunk]:
        if not (inputs.prompt_logprob_targets >= 0).any():  # nobody's prompt scored: no row to look at
            return {}
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
