"""Prompt-token logprobs, scored PROMPT_ROWS_PER_CHUNK rows at a time, against numpy."""

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.worker.sample.logprobs import PROMPT_ROWS_PER_CHUNK, prompt_logprobs


def test_prompt_logprobs_over_several_chunks_match_numpy():
    num_rows, hidden_size, vocab, top = 3 * PROMPT_ROWS_PER_CHUNK, 8, 40, 4
    rng = np.random.default_rng(0)
    head = rng.normal(size=(hidden_size, vocab)).astype(np.float32)
    hidden = rng.normal(size=(num_rows, hidden_size)).astype(np.float32)
    targets = np.where(np.arange(num_rows) % 5 == 0, -1, rng.integers(0, vocab, num_rows)).astype(np.int32)
    got = jax.jit(lambda h, t: prompt_logprobs(lambda x: x @ jnp.asarray(head), h, t, top))(hidden, targets)
    logits = (hidden.astype(np.float64) @ head).astype(np.float64)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    scored = targets >= 0
    rows = np.flatnonzero(scored)
    np.testing.assert_allclose(np.asarray(got.logprobs)[rows], ref[rows, targets[rows]], atol=1e-4)
    assert np.asarray(got.ranks)[rows].tolist() == [int(np.sum(ref[i] >= ref[i, targets[i]])) for i in rows]
    np.testing.assert_array_equal(np.asarray(got.top_ids), np.argsort(-ref, axis=-1)[:, :top])
    np.testing.assert_allclose(np.asarray(got.top_logprobs), -np.sort(-ref, axis=-1)[:, :top], atol=1e-4)


def test_a_step_without_targets_skips_the_projection():
    hidden = jnp.ones((16, 4))
    out = prompt_logprobs(lambda x: x @ jnp.ones((4, 10)), hidden, jnp.full(16, -1), 3)
    assert not np.asarray(out.top_logprobs).any() and not np.asarray(out.ranks).any()
