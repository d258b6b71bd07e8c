"""Draft-model proposer (speculative_config method "draft_model", vLLM's): a smaller model with the
target's vocabulary proposes k tokens greedily for every speculating request, in one batch.

The draft has its own paged KV pool, block manager and block tables, sized for R = draft rows requests
of max_model_len + k tokens: the requests of one proposal always fit once every other request's draft
KV is dropped, so a request's draft KV is a cache that is freed when it finishes, is aborted or
preempted, or when a proposal needs its blocks (it is then recomputed from its first token). Draft KV of
drafts the target rejected is overwritten: each proposal rolls the request's computed count back to
its tokens the draft fed itself and that the target kept.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from cbjax.checkpoint.loader import load_model
from cbjax.checkpoint.resolve import resolve_model
from cbjax.core.kv.block_manager import BlockManager
from cbjax.core.request import Request, RequestStatus
from cbjax.core.spec.config import SpeculativeConfig
from cbjax.models.config import ModelConfig
from cbjax.models.layers.attention import AttentionPlan, resolve_backend
from cbjax.models.layers.kv_pool import init_kv_pool
from cbjax.tokenizer.tokenizer import Tokenizer
from cbjax.worker.compilation.buckets import powers_of_two
from cbjax.worker.kv_scales import calibrate_kv_scales, use_checkpoint_kv_scales
from cbjax.worker.model_runner import kv_cache_dtype, matmul_precision
from cbjax.worker.spec.draft_rows import draft_rows_needed
from cbjax.worker.spec.draft_steps import DraftStepInputs, draft_program


@dataclasses.dataclass(eq=False)
class DraftSequence:
    """One request's tokens in the draft's pool (the fields BlockManager reads and writes)."""

    request: Request
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens of request.all_token_ids whose draft KV is written
    num_registered_blocks: int = 0  # (no prefix caching in the draft pool)
    # The drafts whose KV the last proposal wrote after the request's num_proposed_from tokens: the
    # ones the target accepted stay computed.
    num_proposed_from: int = 0
    fed_drafts: list[int] = dataclasses.field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def roll_back(self) -> None:
        """Count as computed only the fed drafts that became the request's tokens."""
        tokens, start = self.request.all_token_ids, self.num_proposed_from
        kept = 0
        for draft, token in zip(self.fed_drafts, tokens[start:]):
            if draft != token:
                break
            kept += 1
        self.num_computed_tokens = min(self.num_computed_tokens, start + kept)
        self.fed_drafts = []


def check_draft_model(draft: ModelConfig, target_vocab_size: int, max_model_len: int, model_dir: str) -> None:
    """A draft must score the target's tokens and reach max_model_len."""
    if draft.vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config model={model_dir!r} has vocab_size {draft.vocab_size}; the target model "
                         f"has {target_vocab_size}; a draft model must share the target's tokenizer and vocabulary")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config model={model_dir!r} has max_position_embeddings "
                         f"{draft.max_position_embeddings}, below max_model_len={max_model_len}; lower max_model_len "
                         "or use a draft model with a longer context")


class DraftModelProposer:
    """The Drafter (core/spec/speculation.py) that runs a draft model on the device."""

    def __init__(self, spec: SpeculativeConfig, config: Any, target_vocab_size: int, *, dtype: str,
                 activation_dtype: str | None):
        if config.tensor_parallel_size > 1 or config.num_processes > 1:
            raise ValueError(f"speculative_config method='draft_model' is not supported with tensor_parallel_size="
                             f"{config.tensor_parallel_size}, num_processes={config.num_processes}; serve the target "
                             "on one device, or use method 'ngram' or 'suffix'")
        self.k = spec.num_speculative_tokens
        if not (Path(spec.model).expanduser() / "config.json").is_file():
            raise ValueError(f"speculative_config model={spec.model!r} is not a model directory (no config.json); pass "
                             "the draft's converted checkpoint or Hugging Face directory")
        # Checked before any weight is read or an HF directory converted.
        check_draft_model(ModelConfig.from_dir(Path(spec.model).expanduser()), target_vocab_size, config.max_model_len,
                          spec.model)
        draft_dir = resolve_model(spec.model)
        model, self.model_config = load_model(draft_dir, dtype=dtype, activation_dtype=activation_dtype)
        self.block_size = bs = config.block_size
        # Its own fp8 pool's scales: its checkpoint's, or calibrated like the target's (the jnp path: the draft's
        # weights are not packed).
        self.kv_scales = use_checkpoint_kv_scales(model, draft_dir, config.kv_cache_dtype,
                                                  config.calculate_kv_scales)
        if config.calculate_kv_scales:
            self.kv_scales = calibrate_kv_scales(model, Tokenizer.from_dir(config.tokenizer or config.model), bs,
                                                 AttentionPlan("xla"), config.max_model_len)
        self.attention_backend = config.attention_backend
        self.num_rows = max(2, draft_rows_needed(config))  # two rows at least: XLA:CPU's one-row dots are slow
        self.max_blocks = -(-(config.max_model_len + self.k) // bs)
        num_blocks = self.num_rows * self.max_blocks + 1  # the null block too
        self.blocks = BlockManager(num_blocks, bs)
        pool_dtype = kv_cache_dtype(config.kv_cache_dtype, model)
        self.kv_pool = init_kv_pool(self.model_config, num_blocks, bs, pool_dtype)
        self._graphdef, state = nnx.split(model)
        self.weights, self._state_treedef = jax.tree_util.tree_flatten(state)
        self.matmul_precision = matmul_precision(model.activation_dtype, jax.devices()[0].platform)
        # Tokens of one pass: a proposal feeds longer news (a prompt) in several.
        self.token_buckets = powers_of_two(min(8, config.max_num_batched_tokens), config.max_num_batched_tokens)
        self.compiled: dict[int, Any] = {}
        self.sequences: dict[str, DraftSequence] = {}  # in the order they last proposed: evicted first to last

    # ---- start-up ----------------------------------------------------------------

    def precompile(self, progress: bool = True) -> None:
        """Compile one program per token bucket, so proposing never compiles, and run each once."""
        for num_tokens in tqdm(self.token_buckets, desc="compiling draft steps", disable=not progress):
            inputs = DraftStepInputs.empty(num_tokens, self.num_rows, self.max_blocks)
            inputs.query_start_loc[1:] = inputs.seq_lens[0] = 1  # one token in the null block: the loop's body runs
            self.kv_pool, drafts = self._executable(num_tokens)(self.weights, self.kv_pool, inputs)
            drafts.block_until_ready()

    @functools.cached_property
    def _program(self) -> Any:
        # Resolved when first compiled, after the target's steps: a C++ kernel still building is ready then.
        config = self.model_config
        backend = resolve_backend(self.attention_backend, num_q_heads=config.num_attention_heads,
                                  num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                  block_size=self.block_size)
        return draft_program(self._graphdef, self._state_treedef, backend, self.block_size, self.k)

    def _executable(self, num_tokens: int) -> Any:
        """The compiled program of a token bucket (compiled now if start-up did not: precompile=False)."""
        compiled = self.compiled.get(num_tokens)
        if compiled is None:
            inputs = DraftStepInputs.empty(num_tokens, self.num_rows, self.max_blocks)
            with jax.default_matmul_precision(self.matmul_precision):
                compiled = self.compiled[num_tokens] = self._program.lower(self.weights, self.kv_pool, inputs).compile()
        return compiled

    # ---- proposing ---------------------------------------------------------------

    def draft(self, requests: list[Request]) -> list[list[int]]:
        """k greedy drafts for each of the first num_rows requests (none for any beyond)."""
        self._drop_stopped()
        batch = [self._sequence_for(request) for request in requests[: self.num_rows]]
        for sequence in batch:
            sequence.roll_back()
            self._allocate(sequence, batch)
        drafts = self._propose(batch)
        for sequence, proposed in zip(batch, drafts):
            sequence.num_proposed_from = sequence.request.num_tokens
            sequence.fed_drafts = proposed[:-1]  # the loop fed all but the last
            sequence.num_computed_tokens = sequence.num_proposed_from + len(sequence.fed_drafts)
        return drafts + [[] for _ in requests[self.num_rows :]]

    def finish(self, request: Request) -> None:
        """The request finished or was aborted: its draft blocks go back."""
        sequence = self.sequences.pop(request.request_id, None)
        if sequence is not None:
            self.blocks.free(sequence)

    @property
    def num_held_blocks(self) -> int:
        """Draft blocks held by requests (0 once every request is done: nothing leaks)."""
        return self.blocks.num_usable_blocks - self.blocks.num_free_blocks

    def _drop_stopped(self) -> None:
        """Free the draft KV of requests no longer running: preempted ones (finished ones go by finish)."""
        for request_id in [i for i, s in self.sequences.items() if s.request.status is not RequestStatus.RUNNING]:
            self.blocks.free(self.sequences.pop(request_id))

    def _sequence_for(self, request: Request) -> DraftSequence:
        sequence = self.sequences.pop(request.request_id, None)
        if sequence is None or sequence.request is not request:  # a new request, or a reused id
            if sequence is not None:
                self.blocks.free(sequence)
            sequence = DraftSequence(request)
        self.sequences[request.request_id] = sequence  # now the most recently used
        return sequence

    def _allocate(self, sequence: DraftSequence, batch: list[DraftSequence]) -> None:
        """Blocks for the request's tokens and the k - 1 drafts the loop feeds; other requests' draft KV,
        least recently used first, makes room (the pool holds num_rows full-length requests)."""
        num_new = sequence.request.num_tokens + self.k - 1 - sequence.num_computed_tokens
        idle = (s for s in list(self.sequences.values()) if s not in batch)
        while not self.blocks.can_allocate(sequence, num_new):
            victim = next(idle)
            self.blocks.free(victim)
            del self.sequences[victim.request_id]
        self.blocks.allocate(sequence, num_new)

    def _propose(self, batch: list[DraftSequence]) -> list[list[int]]:
        """Feed each sequence its uncomputed tokens, in passes of at most the largest bucket's tokens;
        a row's drafts are those of the pass that fed its last token."""
        fed = [s.num_computed_tokens for s in batch]
        drafts: list[list[int]] = [[] for _ in batch]
        while any(f < s.request.num_tokens for f, s in zip(fed, batch)):
            budget, chunks = self.token_buckets[-1], []
            for i, sequence in enumerate(batch):
                n = min(sequence.request.num_tokens - fed[i], budget)
                chunks.append((i, fed[i], n))
                budget -= n
            proposed = self._run(batch, chunks)
            for i, start, n in chunks:
                fed[i] = start + n
                if n and fed[i] == batch[i].request.num_tokens:
                    drafts[i] = proposed[i].tolist()
        return drafts

    def _run(self, batch: list[DraftSequence], chunks: list[tuple[int, int, int]]) -> np.ndarray:
        """One pass: row i feeds tokens [start, start + n) of batch[i]; its drafts after them [rows, k]."""
        num_tokens = sum(n for _, _, n in chunks)
        bucket = next(size for size in self.token_buckets if size >= num_tokens)
        inputs = DraftStepInputs.empty(bucket, self.num_rows, self.max_blocks)
        offset, bs = 0, self.block_size
        for i, start, n in chunks:
            sequence = batch[i]
            positions = np.arange(start, start + n, dtype=np.int32)
            block_ids = np.asarray(sequence.block_ids, np.int32)
            inputs.token_ids[offset : offset + n] = sequence.request.all_token_ids[start : start + n]
            inputs.positions[offset : offset + n] = positions
            inputs.slot_mapping[offset : offset + n] = block_ids[positions // bs] * bs + positions % bs
            offset += n
            inputs.query_start_loc[i + 1] = offset
            if n:  # a row with nothing to feed stays padding: its loop writes into the null block only
                inputs.seq_lens[i] = start + n
                inputs.block_tables[i, : len(block_ids)] = block_ids
        inputs.query_start_loc[len(chunks) + 1 :] = offset
        self.kv_pool, drafts = self._executable(bucket)(self.weights, self.kv_pool, inputs)
        return np.asarray(drafts)
