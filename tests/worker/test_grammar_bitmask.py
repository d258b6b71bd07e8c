"""The device mask against llguidance's own numpy apply_token_bitmask_inplace (the reference layout)."""

import jax.numpy as jnp
import llguidance.numpy
import numpy as np
import pytest

from cbjax.worker.sample.grammar_bitmask import apply_grammar_bitmask


@pytest.mark.parametrize("vocab, words", [(70, 3), (64, 2), (96, 2)])  # ragged last word; exact; vocab past the mask
def test_mask_matches_llguidance_numpy_reference(vocab, words):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(2, words), dtype=np.int64).astype(np.int32)
    mask_rows = np.array([1, -1, 0, 1, -1], np.int32)
    expected = logits.copy()
    for row, mask_row in enumerate(mask_rows):
        if mask_row >= 0:
            padded = np.zeros(max(vocab, 32 * words), np.float32)
            padded[:vocab] = expected[row]
            llguidance.numpy.apply_token_bitmask_inplace(padded[None], bitmask[mask_row][None])
            expected[row] = padded[:vocab]
            expected[row, 32 * words:] = -np.inf  # ids the mask does not cover are disallowed
    got = np.asarray(apply_grammar_bitmask(jnp.asarray(logits), jnp.asarray(mask_rows), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(got[[1, 4]]).all()  # unconstrained rows untouched
