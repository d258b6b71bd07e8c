"""On-device sampler against independent numpy references of vLLM's semantics.

Statistical tests draw N tokens of one request at N different counters (one
batched call) and compare the counts with the exact filtered distribution by a
chi-square test (p-value floor 1e-4, fixed seeds, so the outcome is fixed too);
tokens the filters exclude must never appear at all.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.worker.sample import penalties, top_k_top_p
from cbjax.worker.sample.penalty_state import NO_SLOT, init_penalty_state, record_step_tokens
from cbjax.worker.sample.sampler import SamplingRow, build_sampling_tensors, sample
from cbjax.worker.sample.temperature import PADDING_TEMPERATURE
from cbjax.sampling_params import SamplingParams

VOCAB = 12
SUPPRESS_LEN = 4
BATCH = 8  # small tests share this row count (and the draws NUM_DRAWS) to share compilations
NUM_DRAWS = 4000
sample_jit = jax.jit(sample, static_argnames="num_logprobs")


def history_state(histories: list[tuple[list[int], list[int]]], vocab: int = VOCAB):
    """A PenaltyState whose slot i holds histories[i] = (prompt, output), recorded as one step would."""
    token_ids, positions, slots, prompt_lens = [], [], [], []
    for slot, (prompt, output) in enumerate(histories):
        tokens = list(prompt) + list(output)
        token_ids += tokens
        positions += range(len(tokens))
        slots += [slot] * len(tokens)
        prompt_lens += [len(prompt)] * len(tokens)
    as_array = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return record_step_tokens(init_penalty_state(max(len(histories), 1), vocab), as_array(token_ids),
                              as_array(positions), as_array(slots), as_array(prompt_lens))


NO_HISTORY = history_state([])


def chi2_sf(statistic: float, dof: int) -> float:
    """Chi-square survival function for integer dof (closed forms of the regularised gamma Q)."""
    half = statistic / 2
    if dof % 2 == 0:
        term = total = math.exp(-half)
        for i in range(1, dof // 2):
            term *= half / i
            total += term
        return total
    total = math.erfc(math.sqrt(half))
    term = math.exp(-half) * math.sqrt(half) / math.gamma(1.5)
    for i in range(1, (dof + 1) // 2):
        total += term
        term *= half / (i + 0.5)
    return total


def test_chi2_sf_matches_tabulated_critical_values():
    for statistic, dof in [(3.841458820694124, 1), (5.991464547107979, 2),
                           (11.070497693516351, 5), (18.307038053275146, 10)]:
        assert chi2_sf(statistic, dof) == pytest.approx(0.05, rel=1e-9)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expecting fewer than 5 are pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(np.sum((observed - expected) ** 2 / expected))
    return chi2_sf(statistic, len(expected) - 1)


def softmax(x: np.ndarray) -> np.ndarray:
    weights = np.exp(x - x.max())
    return weights / weights.sum()


def reference_penalised(logits, prompt, output, params: SamplingParams) -> np.ndarray:
    """vLLM: repetition over prompt+output (positive /, negative *), frequency/presence over output."""
    out = logits.astype(np.float64).copy()
    for token in set(prompt) | set(output):
        out[token] = out[token] / params.repetition_penalty if out[token] > 0 \
            else out[token] * params.repetition_penalty
    counts = np.bincount(np.asarray(output, int), minlength=len(logits))
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """vLLM V1's definition: temperature; min-p keeps p >= min_p * p_max (MinPLogitsProcessor, an
    argmax-invariant processor, runs before TopKTopPSampler); top-k; top-p drops a token when the
    mass of the kept tokens at or below it (ascending cumsum) is <= 1 - top_p."""
    scaled = logits / params.temperature
    keep = np.ones(len(logits), bool)
    if params.min_p > 0:
        probs = softmax(scaled)
        keep &= probs >= params.min_p * probs.max()
    order = np.argsort(-scaled, kind="stable")
    if params.top_k > 0:
        keep[order[params.top_k:]] = False
    if params.top_p < 1:
        ascending = order[::-1]
        mass_up_to = np.cumsum(softmax(np.where(keep, scaled, -np.inf))[ascending])
        assert np.all(np.abs(mass_up_to - (1 - params.top_p)) > 1e-3), "top_p too close to a boundary"
        dropped = mass_up_to <= 1 - params.top_p
        dropped[-1] = False  # at least one token stays
        keep[ascending[dropped]] = False
    return softmax(np.where(keep, scaled, -np.inf))


def draw(logits: np.ndarray, params: SamplingParams, num_draws: int, prompt=(), output=(), seed=1234):
    """num_draws samples of one request: one row per counter, all in one batch, its history in slot 0."""
    rows = [SamplingRow(params, seed, counter, penalty_slot=0) for counter in range(num_draws)]
    tensors = build_sampling_tensors(rows, num_draws, SUPPRESS_LEN)
    batch = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (num_draws, len(logits)))
    return np.asarray(sample_jit(batch, tensors, history_state([(prompt, output)])).token_ids)


LOGITS = np.array([2.1, 1.7, 1.5, 1.0, 0.8, 0.3, 0.0, -0.4, -0.9, -1.3, -2.0, -3.1], np.float32)
# min-p keeps tokens 0-5; top-p 0.7 over their mass then keeps 0-2, over the whole vocabulary 0-3.
MIN_P_THEN_TOP_P = SamplingParams(temperature=1.0, top_p=0.7, min_p=0.15)


def test_min_p_runs_before_top_p_as_in_vllm():
    """The order matters for MIN_P_THEN_TOP_P: the old order (top-p over all, then min-p) keeps token 3."""
    kept = reference_probs(LOGITS.astype(np.float64), MIN_P_THEN_TOP_P) > 0
    assert np.flatnonzero(kept).tolist() == [0, 1, 2]
    top_p_first = reference_probs(LOGITS.astype(np.float64), SamplingParams(temperature=1.0, top_p=0.7)) > 0
    assert np.flatnonzero(top_p_first).tolist() == [0, 1, 2, 3]  # min-p 0.15 afterwards keeps all four
    assert set(np.unique(draw(LOGITS, MIN_P_THEN_TOP_P, NUM_DRAWS))) == {0, 1, 2}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.2, top_p=0.75),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=0.9, top_k=7, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.5, top_k=9, top_p=0.93),
    MIN_P_THEN_TOP_P,
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
def test_sampled_frequencies_match_the_exact_filtered_distribution(params):
    probs = reference_probs(LOGITS.astype(np.float64), params)
    counts = np.bincount(draw(LOGITS, params, NUM_DRAWS), minlength=VOCAB)
    assert np.all(counts[probs == 0] == 0), f"excluded tokens sampled: {counts} vs {probs}"
    assert chi2_pvalue(counts[probs > 0], probs[probs > 0]) > 1e-4, (counts, probs)


def test_penalised_sampling_matches_reference_distribution():
    params = SamplingParams(temperature=0.7, top_k=8, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.3)
    prompt, output = [0, 3, 8], [1, 1, 4, 9]
    penalised = reference_penalised(LOGITS, prompt, output, params)
    probs = reference_probs(penalised, params)
    counts = np.bincount(draw(LOGITS, params, NUM_DRAWS, prompt, output), minlength=VOCAB)
    assert np.all(counts[probs == 0] == 0)
    assert chi2_pvalue(counts[probs > 0], probs[probs > 0]) > 1e-4, (counts, probs)


def test_apply_penalties_matches_vllm_formulas():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, VOCAB)).astype(np.float32) * 2
    params = [SamplingParams(presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.5),
              SamplingParams(presence_penalty=-0.7, repetition_penalty=0.8),
              SamplingParams(frequency_penalty=1.1),
              SamplingParams(),
              SamplingParams(repetition_penalty=2.0)]
    histories = [([0, 1, 2], [2, 2, 5]), ([4], [4, 7, 7, 7]), ([3, 3], [3, 6]), ([1], [1]), ([], [9, 10])]
    rows = [SamplingRow(p, 0, len(out), penalty_slot=i) for i, (p, out) in enumerate(zip(params, histories))]
    tensors = jax.tree.map(jnp.asarray, build_sampling_tensors(rows, 5, SUPPRESS_LEN))
    got = np.asarray(penalties.apply_penalties(jnp.asarray(logits), tensors, history_state(histories)))
    for i, (p, (prompt, out)) in enumerate(zip(params, histories)):
        np.testing.assert_allclose(got[i], reference_penalised(logits[i], prompt, out, p), rtol=1e-6, atol=1e-6)


def test_greedy_is_argmax_of_penalised_logits():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(BATCH, VOCAB)).astype(np.float32)
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.0, repetition_penalty=3.0)]
    history = [0] + [int(np.argmax(logits[5]))]
    rows = [SamplingRow(p, i, 0, penalty_slot=0) for i, p in enumerate(params)]
    state = history_state([(history, [])])
    tokens = np.asarray(sample_jit(jnp.asarray(logits), build_sampling_tensors(rows, BATCH, SUPPRESS_LEN), state).token_ids)[:6]
    expected = [int(np.argmax(row)) for row in logits[:5]]
    expected.append(int(np.argmax(reference_penalised(logits[5], history, [], params[5]))))
    assert tokens.tolist() == expected
    assert expected[5] != np.argmax(logits[5])


def test_all_greedy_batch_matches_the_same_rows_in_a_mixed_batch():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(BATCH, VOCAB)).astype(np.float32))
    greedy = [SamplingRow(SamplingParams(temperature=0.0), i, 0) for i in range(7)]
    random_row = SamplingRow(SamplingParams(temperature=1.0, top_k=3, presence_penalty=0.5), 9, 0, penalty_slot=0)
    state = history_state([([1], [2])])
    all_greedy = sample_jit(logits, build_sampling_tensors(greedy, BATCH, SUPPRESS_LEN), state).token_ids
    mixed = sample_jit(logits, build_sampling_tensors(greedy + [random_row], BATCH, SUPPRESS_LEN), state).token_ids
    assert np.asarray(all_greedy)[:7].tolist() == np.argmax(np.asarray(logits), -1)[:7].tolist()
    assert np.asarray(all_greedy)[:7].tolist() == np.asarray(mixed)[:7].tolist()


def test_seeded_row_samples_the_same_token_whatever_the_batch():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=VOCAB).astype(np.float32)
    probe = [SamplingRow(SamplingParams(temperature=1.3, top_p=0.9), seed, counter)
             for seed, counter in [(7, 0), (7, 1), (8, 0), (2**33 + 5, 4)]]
    filler = [SamplingRow(SamplingParams(temperature=0.6, top_k=2, frequency_penalty=1.0), 99, 3, penalty_slot=0),
              SamplingRow(SamplingParams(temperature=0.0), 1, 0)]
    state = history_state([([5], [5, 6])])

    def tokens_of_probes(rows, num_rows, positions):
        tensors = build_sampling_tensors(rows, num_rows, SUPPRESS_LEN)
        tokens = np.asarray(sample_jit(jnp.broadcast_to(logits, (num_rows, VOCAB)), tensors, state).token_ids)
        return [int(tokens[position]) for position in positions]

    alone = tokens_of_probes(probe, BATCH, [0, 1, 2, 3])
    reordered = [filler[0], probe[3], probe[1], filler[1], probe[0], probe[2]]
    assert tokens_of_probes(reordered, BATCH, [4, 2, 5, 1]) == alone
    assert len(set(np.unique(draw(logits, probe[0].params, NUM_DRAWS)))) > 1  # the rows really are random


def test_suppressed_tokens_are_never_sampled():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=3.0)]
    half = NUM_DRAWS // 2
    rows = [SamplingRow(p, 5, c, suppress_token_ids=[0, 11]) for p in params for c in range(half)]
    tensors = build_sampling_tensors(rows, NUM_DRAWS, SUPPRESS_LEN)
    tokens = np.asarray(sample_jit(jnp.broadcast_to(LOGITS, (NUM_DRAWS, VOCAB)), tensors, NO_HISTORY).token_ids)
    assert np.all(tokens[:half] == 1)  # greedy takes the next best token
    assert not np.isin(tokens[half:], [0, 11]).any()
    assert len(np.unique(tokens[half:])) == VOCAB - 2


def numpy_rank(logprobs: np.ndarray, token: int) -> int:
    """vLLM's rank: 1 + the number of other tokens at least as likely (ties count against the token)."""
    return int(np.sum(logprobs >= logprobs[token]))


def test_logprobs_are_raw_log_softmax_with_top_n_in_order():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(BATCH, VOCAB)).astype(np.float32) * 3
    params = SamplingParams(temperature=0.5, repetition_penalty=1.7, top_k=3, logprobs=5)
    rows = [SamplingRow(params, i, 0, suppress_token_ids=[5], penalty_slot=0) for i in range(BATCH)]
    tensors = build_sampling_tensors(rows, BATCH, SUPPRESS_LEN)
    state = history_state([([0, 1, 2], [])])
    out = sample_jit(jnp.asarray(logits), tensors, state, num_logprobs=5)
    raw = np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs.logprobs), raw[np.arange(BATCH), tokens], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.logprobs.top_ids), np.argsort(-raw, axis=-1)[:, :5])
    np.testing.assert_allclose(np.asarray(out.logprobs.top_logprobs), -np.sort(-raw, axis=-1)[:, :5], rtol=1e-5)
    assert np.asarray(out.logprobs.ranks).tolist() == [numpy_rank(raw[i], t) for i, t in enumerate(tokens)]
    # A batch where no request asked for logprobs skips computing them (they come back zero).
    plain = build_sampling_tensors([r._replace(params=SamplingParams(temperature=0.5)) for r in rows],
                                   BATCH, SUPPRESS_LEN)
    skipped = sample_jit(jnp.asarray(logits), plain, state, num_logprobs=5).logprobs
    assert not np.asarray(skipped.top_logprobs).any() and not np.asarray(skipped.logprobs).any()
    assert sample_jit(jnp.asarray(logits), tensors, state).logprobs is None


def test_sampled_token_rank_is_its_true_rank_outside_the_top_n_and_with_logprobs_0():
    """High temperature over a flat vocabulary samples tokens far below the top 2; logprobs=0 rows
    still get their rank; tied logits share the worse rank, as vLLM counts them."""
    vocab = 64
    logits = np.linspace(1.0, -1.0, vocab).astype(np.float32)
    logits[[10, 11]] = logits[10]  # a tie
    rows = [SamplingRow(SamplingParams(temperature=50.0, logprobs=n), 3, counter)
            for counter, n in enumerate([0, 2] * (BATCH // 2))]
    tensors = build_sampling_tensors(rows, BATCH, SUPPRESS_LEN)
    out = sample_jit(jnp.broadcast_to(logits, (BATCH, vocab)), tensors, history_state([], vocab), num_logprobs=2)
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    tokens = np.asarray(out.token_ids)
    assert np.asarray(out.logprobs.ranks).tolist() == [numpy_rank(raw, t) for t in tokens]
    assert (np.asarray(out.logprobs.ranks) > 2).sum() >= BATCH // 2  # most draws lie outside the top 2
    tied = np.zeros((BATCH, vocab), np.float32)  # greedy on a flat row takes token 0, tied with all
    greedy = build_sampling_tensors([SamplingRow(SamplingParams(temperature=0.0, logprobs=0), 0, 0)], BATCH, SUPPRESS_LEN)
    out = sample_jit(jnp.asarray(tied), greedy, history_state([], vocab), num_logprobs=2)
    assert int(out.token_ids[0]) == 0 and int(out.logprobs.ranks[0]) == vocab


def reference_keep(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    keep = np.ones(len(scaled), bool)
    order = np.argsort(-scaled, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    probs = softmax(np.where(keep, scaled.astype(np.float64), -np.inf))[order]
    keep[order[(np.cumsum(probs) - probs) >= top_p]] = False
    return keep


def test_top_k_top_p_mask_is_exact_on_both_paths():
    """Rows whose kept set fits in the candidates, and rows that force the bisection fallback."""
    vocab = 600
    rng = np.random.default_rng(5)
    peaked = rng.normal(size=vocab) * 4
    flat = rng.normal(size=vocab) * 0.2
    cases = [(peaked, 20, 1.0), (peaked, 0, 0.9), (peaked, 50, 0.8), (flat, 400, 1.0), (flat, 0, 0.9), (flat, 500, 0.5)]
    scaled = jnp.asarray(np.stack([c[0] for c in cases]), jnp.float32)
    top_k = jnp.asarray([c[1] for c in cases], jnp.int32)
    top_p = jnp.asarray([c[2] for c in cases], jnp.float32)
    _, fits = jax.jit(top_k_top_p._cutoff_from_candidates)(scaled, top_k, top_p)
    assert np.asarray(fits).tolist() == [True, True, True, False, False, False]
    for rows in ([0, 1, 2], list(range(6))):  # fast path alone, then the fallback for all
        rows_idx = np.asarray(rows)
        masked = np.asarray(jax.jit(top_k_top_p._top_k_top_p)(scaled[rows_idx], top_k[rows_idx], top_p[rows_idx]))
        for out_row, i in zip(masked, rows):
            expected = reference_keep(np.asarray(scaled[i]), cases[i][1], cases[i][2])
            np.testing.assert_array_equal(np.isfinite(out_row), expected, err_msg=f"case {i}")


def test_sampling_never_sorts_the_whole_vocabulary():
    """Sorting 49152 logits per row costs seconds on CPU; XLA must see top_k / bisection only."""
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_k=40, top_p=0.9), 0, 0)]
    tensors = build_sampling_tensors(rows, 2, 2)
    hlo = sample_jit.lower(jnp.zeros((2, 49152)), tensors, history_state([], 49152), num_logprobs=5).compile().as_text()
    assert "f32[2,49152]{1,0} sort(" not in hlo


def test_builder_pads_with_neutral_padding_rows():
    rows = [SamplingRow(SamplingParams(temperature=0.7, top_k=-1), 2**32 + 3, 5),
            SamplingRow(SamplingParams(repetition_penalty=1.2, temperature=0.0), 1, 1, [7, 8], penalty_slot=3)]
    t = build_sampling_tensors(rows, 4, 3)
    assert t.temperature.tolist() == pytest.approx([0.7, 0.0, PADDING_TEMPERATURE, PADDING_TEMPERATURE])
    assert t.top_k.tolist() == [0, 0, 0, 0] and t.top_p.tolist() == [1, 1, 1, 1]
    assert t.repetition_penalty.tolist() == pytest.approx([1.0, 1.2, 1.0, 1.0])
    assert t.seeds.dtype == np.uint32 and t.seeds.tolist() == [3, 1, 0, 0]
    assert t.counters.tolist() == [5, 1, 0, 0]
    assert t.penalty_slots.tolist() == [NO_SLOT, 3, NO_SLOT, NO_SLOT]
    assert t.suppress_token_ids.tolist() == [[-1] * 3, [7, 8, -1], [-1] * 3, [-1] * 3]


@pytest.mark.parametrize("rows, message", [
    ([SamplingRow(SamplingParams(), 0, 0)] * 3, r"3 rows to sample but num_rows_padded is 2"),
    ([SamplingRow(SamplingParams(presence_penalty=1.0), 0, 0)], r"row 0 has penalties but no penalty_slot"),
    ([SamplingRow(SamplingParams(), 0, 0, [1, 2, 3, 4])], r"row 0 has 4 suppress_token_ids but the column holds 3"),
])
def test_builder_errors_name_the_value_and_limit(rows, message):
    with pytest.raises(ValueError, match=message):
        build_sampling_tensors(rows, 2, 3)


@pytest.mark.parametrize("greedy_rows", [0, 1])
def test_padding_rows_never_change_the_real_rows_tokens(greedy_rows):
    """With and without a greedy row (the argmax runs only then), real rows get what they get alone."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (4, 300)) * 2
    params = [SamplingParams(temperature=0.0)] * greedy_rows + [SamplingParams(temperature=0.9, seed=5)]
    rows = [SamplingRow(p, 7 + i, i) for i, p in enumerate(params)]
    state = history_state([], 300)
    padded = sample_jit(logits, build_sampling_tensors(rows, 4, 2), state, num_logprobs=None).token_ids
    alone = [
        int(sample_jit(logits[i : i + 1], build_sampling_tensors([row], 1, 2), state, num_logprobs=None).token_ids[0])
        for i, row in enumerate(rows)
    ]
    assert padded[: len(rows)].tolist() == alone
    if greedy_rows:
        assert alone[0] == int(jnp.argmax(logits[0]))
