import jax
import jax.numpy as jnp
import numpy as np

from cbjax.worker.sample.rejection import REJECTED, greedy_rejection_sample, rejection_sample

N = 100_000
# Target distributions at three verified positions of a 4-token vocabulary.
P = np.array([[0.1, 0.3, 0.4, 0.2], [0.5, 0.1, 0.15, 0.25], [0.25, 0.25, 0.1, 0.4]], np.float32)


def run(probs, drafts, num_draft, greedy, seed=0):
    rows = len(drafts)
    keys = jax.random.split(jax.random.key(seed), rows)
    tokens, accepted = rejection_sample(jnp.asarray(probs), jnp.asarray(drafts, jnp.int32),
                                        jnp.asarray(num_draft, jnp.int32), jnp.asarray(greedy), keys)
    return np.asarray(tokens), np.asarray(accepted)


def total_variation(samples, p):
    return 0.5 * np.abs(np.bincount(samples, minlength=len(p)) / len(samples) - p).sum()


def test_greedy_accepts_while_draft_is_argmax():
    # argmax per position: 2, 0, 3
    probs = np.broadcast_to(P, (3, *P.shape))
    tokens, accepted = run(probs, [[2, 1], [2, 0], [2, 0]], [2, 2, 1], [True] * 3)
    assert tokens.tolist() == [[2, 0, REJECTED], [2, 0, 3], [2, 0, REJECTED]]
    assert accepted.tolist() == [1, 2, 1]


def test_greedy_rows_from_the_argmax_alone_match_the_probability_path():
    # Random argmax chains and drafts that agree for a random prefix; rows verify 0..k drafts.
    rng = np.random.default_rng(0)
    rows, k, vocab = 64, 4, 5
    target_ids = rng.integers(0, vocab, (rows, k + 1))
    drafts = np.where(rng.random((rows, k)) < 0.7, target_ids[:, :k], rng.integers(0, vocab, (rows, k)))
    num_draft = rng.integers(0, k + 1, rows)
    one_hot = np.eye(vocab, dtype=np.float32)[target_ids]
    expected = run(one_hot, drafts, num_draft, np.ones(rows, bool))
    tokens, accepted = greedy_rejection_sample(jnp.asarray(target_ids, jnp.int32), jnp.asarray(drafts, jnp.int32),
                                               jnp.asarray(num_draft, jnp.int32))
    assert np.asarray(tokens).tolist() == expected[0].tolist() and np.asarray(accepted).tolist() == expected[1].tolist()
    assert {0, k} <= set(expected[1].tolist())  # the cases cover no draft accepted and all of them


def test_sampled_output_is_distributed_as_the_target():
    # Drafts the target disagrees with (neither is its argmax), so both rejection and acceptance occur.
    drafts = np.array([1, 3])
    tokens, accepted = run(np.broadcast_to(P, (N, *P.shape)), np.tile(drafts, (N, 1)), np.full(N, 2),
                           np.zeros(N, bool))
    assert 0 < (accepted == 0).sum() and 0 < (accepted == 2).sum()
    assert total_variation(tokens[:, 0], P[0]) < 0.01  # accepted draft or resampled from the residual
    first_kept = tokens[:, 0] == drafts[0]
    assert total_variation(tokens[first_kept, 1], P[1]) < 0.01  # ~30k rows


def test_bonus_token_is_distributed_as_the_target():
    # A likely draft at position 0 (accepted ~70%), then the bonus draw at position 1.
    probs = np.broadcast_to(np.stack([[0.05, 0.7, 0.05, 0.2], P[1], P[2]]), (N, 3, 4)).astype(np.float32)
    tokens, accepted = run(probs, np.tile([1, 0], (N, 1)), np.full(N, 1), np.zeros(N, bool), seed=1)
    assert total_variation(tokens[:, 0], probs[0, 0]) < 0.01
    bonus = accepted == 1
    assert (tokens[bonus, 2] == REJECTED).all()
    assert total_variation(tokens[bonus, 1], P[1]) < 0.01


def test_seeded_rows_verify_reproducibly():
    probs = np.broadcast_to(P, (8, *P.shape))
    first = run(probs, np.tile([1, 3], (8, 1)), np.full(8, 2), np.zeros(8, bool), seed=7)
    again = run(probs, np.tile([1, 3], (8, 1)), np.full(8, 2), np.zeros(8, bool), seed=7)
    assert all((a == b).all() for a, b in zip(first, again))
