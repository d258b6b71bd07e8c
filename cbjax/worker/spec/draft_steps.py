"""The draft model's compiled programs (speculative_config method "draft_model").

One program per token bucket, all compiled at start-up: it writes the KV of each draft row's new
tokens into the draft's own pool (a ragged pass, as a mixed step), takes the argmax after each row's
last token, then runs k - 1 one-token greedy steps inside the same program (vLLM's draft loop), so a
proposal is one call whatever k is. Rows are a fixed R; padding rows have no tokens and no blocks, and
their loop attends to and writes into the null block only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from cbjax.models.layers.attention import AttentionPlan
from cbjax.models.layers.kv_pool import KVPool
from kernels_pallas.reference import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftStepInputs:
    """One pass of the draft rows (numpy on the host, arrays in the program); padding is zeros."""

    token_ids: Int[Array, "tokens"]
    positions: Int[Array, "tokens"]
    slot_mapping: Int[Array, "tokens"]  # padding tokens: the null block
    query_start_loc: Int[Array, "rows_plus_1"]  # padding rows repeat the total
    seq_lens: Int[Array, "rows"]  # tokens in the row's KV after this pass; 0: a padding row
    block_tables: Int[Array, "rows max_blocks"]  # padded with the null block 0

    @classmethod
    def empty(cls, num_tokens: int, num_rows: int, max_blocks: int) -> DraftStepInputs:
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        return cls(zeros(num_tokens), zeros(num_tokens), zeros(num_tokens), zeros(num_rows + 1), zeros(num_rows),
                   zeros(num_rows, max_blocks))


def draft_program(graphdef: Any, state_treedef: Any, backend: str, block_size: int, k: int):
    """propose(weights, kv_pool, inputs) -> (kv_pool, drafts[rows, k]): each row's k greedy tokens after
    its last token in `inputs` (the draft KV of the first k - 1 is written at the positions after it)."""

    def propose(weights: list[jax.Array], kv_pool: KVPool, inputs: DraftStepInputs) -> tuple[KVPool, Int[Array, "rows k"]]:
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, weights))
        num_rows = inputs.seq_lens.shape[0]
        rows = jnp.arange(num_rows, dtype=jnp.int32)
        metadata = AttentionMetadata(inputs.slot_mapping, inputs.query_start_loc, inputs.seq_lens, inputs.block_tables)
        last_rows = jnp.maximum(inputs.query_start_loc[1:] - 1, 0)
        logits, kv_pool = model(inputs.token_ids, inputs.positions, kv_pool, metadata, last_rows,
                                AttentionPlan(backend, False, num_rows))
        drafts = jnp.zeros((num_rows, k), jnp.int32).at[:, 0].set(jnp.argmax(logits, axis=-1).astype(jnp.int32))

        def next_draft(j, carry):  # feed draft j - 1 at the position after the previous one, take draft j
            kv_pool, drafts = carry
            positions = inputs.seq_lens + j - 1
            slots = inputs.block_tables[rows, positions // block_size] * block_size + positions % block_size
            step = AttentionMetadata(slots, jnp.arange(num_rows + 1, dtype=jnp.int32), positions + 1, inputs.block_tables)
            logits, kv_pool = model(drafts[:, j - 1], positions, kv_pool, step, rows, AttentionPlan(backend, True, num_rows))
            return kv_pool, drafts.at[:, j].set(jnp.argmax(logits, axis=-1).astype(jnp.int32))

        return jax.lax.fori_loop(1, k, next_draft, (kv_pool, drafts))

    return jax.jit(propose, donate_argnums=(1,))
