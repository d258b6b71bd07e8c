"""The device-side penalty history against numpy counts of the same tokens, recorded step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.worker.sample.penalty_state import (
    NO_SLOT, init_penalty_state, penalty_state_bytes, record_step_tokens, slot_rows,
)

VOCAB = 16
record = jax.jit(record_step_tokens)


def step(state, *rows):
    """One step's tokens: rows of (slot, prompt_len, first position, token ids)."""
    columns = [[], [], [], []]
    for slot, prompt_len, start, tokens in rows:
        columns[0] += tokens
        columns[1] += range(start, start + len(tokens))
        columns[2] += [slot] * len(tokens)
        columns[3] += [prompt_len] * len(tokens)
    pad = 12 - len(columns[0])  # a fixed-shape step: padding tokens have no slot
    token_ids, positions, slots, prompt_lens = (jnp.asarray(c + [0] * pad, jnp.int32) for c in columns)
    return record(state, token_ids, positions, jnp.where(jnp.arange(12) < 12 - pad, slots, NO_SLOT), prompt_lens)


def expected_rows(prompt, output):
    seen = np.zeros(VOCAB, bool)
    seen[list(prompt) + list(output)] = True
    return seen, np.bincount(output, minlength=VOCAB).astype(np.float32)


def test_chunked_prompt_then_outputs_give_prompt_set_and_output_counts():
    prompt, output = [5, 5, 7, 1, 9], [3, 3, 9, 12]
    state = init_penalty_state(4, VOCAB)
    state = step(state, (2, 5, 0, prompt[:2]), (NO_SLOT, 3, 0, [4, 4, 4]))  # a request without penalties
    state = step(state, (2, 5, 2, prompt[2:]), (0, 1, 0, [11]))
    for i, token in enumerate(output):  # decode steps feed back each sampled token
        state = step(state, (0, 1, 1 + i, [6]), (2, 5, 5 + i, [token]))
    seen, counts = slot_rows(state, jnp.asarray([2, 0, NO_SLOT], jnp.int32))
    want_seen, want_counts = expected_rows(prompt, output)
    np.testing.assert_array_equal(np.asarray(seen[0]), want_seen)
    np.testing.assert_array_equal(np.asarray(counts[0]), want_counts)
    np.testing.assert_array_equal(np.asarray(counts[1]), expected_rows([11], [6] * 4)[1])
    assert not np.asarray(state.prompt_seen[1]).any() and not np.asarray(state.output_counts[3]).any()
    assert not np.asarray(state.prompt_seen[:, 4]).any()  # the no-slot request's tokens went nowhere


def test_restarting_at_position_0_clears_only_that_slot():
    """A preempted request recomputes from position 0; a reused slot starts a new request there too."""
    state = init_penalty_state(3, VOCAB)
    state = step(state, (1, 2, 0, [5, 6, 7, 7]), (2, 1, 0, [8, 9]))
    state = step(state, (1, 2, 0, [5, 6, 7]))  # recompute: prompt and the first output again
    seen, counts = slot_rows(state, jnp.asarray([1, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(counts[0]), expected_rows([5, 6], [7])[1])
    np.testing.assert_array_equal(np.asarray(seen[1]), expected_rows([8], [9])[0])
    np.testing.assert_array_equal(np.asarray(counts[1]), expected_rows([8], [9])[1])


def test_the_bytes_set_aside_for_the_table_are_what_it_allocates():
    # GPU pool sizing reserves this before the table exists (cbjax/engine/llm_engine.py).
    table = init_penalty_state(5, 1000)
    assert penalty_state_bytes(5, 1000) == sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(table))
