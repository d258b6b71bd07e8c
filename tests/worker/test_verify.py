"""The sampler's verification of drafts (sample/verify.py): the target probabilities it builds per position
are the sampling pipeline's, so greedy rows accept exactly the argmax chain and sampled rows emit tokens
distributed as the target's (temperature and top-k applied), checked against numpy."""

import dataclasses

import jax
import numpy as np

from cbjax.sampling_params import SamplingParams
from cbjax.worker.sample.penalty_state import init_penalty_state
from cbjax.worker.sample.rejection import REJECTED
from cbjax.worker.sample.sampler import SamplingRow, build_sampling_tensors
from cbjax.worker.sample.verify import DraftInputs, verify

# Logits after the newest token (position 0) and after the draft (position 1), a vocabulary of 6.
LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 2.5, 1.0, 0.3, 0.0, -0.5]], np.float32)
NUM_ROWS = 20000  # rows of one request with different seeds: one compile serves both tests


VERIFY = jax.jit(verify)


def rows_of(params: SamplingParams, num_rows: int):
    """num_rows copies of one request's sampling row, each with its own seed."""
    one = build_sampling_tensors([SamplingRow(params, 0, 5)], 1)
    tensors = type(one)(**{f.name: np.repeat(getattr(one, f.name), num_rows, axis=0) for f in dataclasses.fields(one)})
    return dataclasses.replace(tensors, seeds=np.arange(num_rows, dtype=np.uint32))


def run(params: SamplingParams, draft: list[int], num_rows: int = NUM_ROWS) -> np.ndarray:
    drafts = DraftInputs(np.arange(num_rows, dtype=np.int32), np.tile(np.arange(len(draft) + 1, dtype=np.int32), (num_rows, 1)),
                         np.tile(np.array(draft, np.int32), (num_rows, 1)), np.full(num_rows, len(draft), np.int32))
    draft_logits = LOGITS[drafts.logits_indices.reshape(-1)]
    verified = VERIFY(draft_logits, drafts, rows_of(params, num_rows), init_penalty_state(1, LOGITS.shape[1]))
    return np.asarray(verified.token_ids)


def target(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    scaled = logits / temperature
    scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    return np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()


def test_a_greedy_row_accepts_the_argmax_chain_and_replaces_the_first_miss():
    greedy = SamplingParams(temperature=0.0)
    assert np.unique(run(greedy, [0]), axis=0).tolist() == [[0, 1]]  # 0 is the argmax at position 0: accepted, then 1
    assert np.unique(run(greedy, [5]), axis=0).tolist() == [[0, REJECTED]]  # 5 is not: 0 in its place


def test_a_sampled_row_emits_the_targets_distribution_at_each_position():
    params, num_rows = SamplingParams(temperature=0.7, top_k=4), NUM_ROWS
    tokens = run(params, [5])  # 5: kept by top-k, but not the likeliest
    first = np.bincount(tokens[:, 0], minlength=6) / num_rows
    assert 0.5 * np.abs(first - target(LOGITS[0], 0.7, 4)).sum() < 0.02
    after_accepted = tokens[tokens[:, 0] == 5, 1]  # the bonus token, drawn at position 1
    second = np.bincount(after_accepted, minlength=6) / len(after_accepted)
    assert len(after_accepted) > 2000 and 0.5 * np.abs(second - target(LOGITS[1], 0.7, 4)).sum() < 0.03
