"""The logits stages logit_bias, allowed_token_ids and bad_words against a numpy reference of vLLM's
semantics (vllm/v1/sample: LogitBiasLogitsProcessor, the allowed-ids mask, ops/bad_words.py) on
random logits, alone and together with min_tokens, in one batch with rows that use none of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.sampling_params import MAX_BAD_WORD_TOKENS, MAX_LOGIT_BIAS, SamplingParams
from cbjax.worker.sample import bad_words
from cbjax.worker.sample.penalty_state import init_penalty_state
from cbjax.worker.sample.sampler import SamplingRow, build_sampling_tensors, process_logits, sample
from cbjax.worker.sample.sharded import needs_whole_rows

VOCAB = 40
NUM_ROWS = 8


def reference(logits: np.ndarray, params: SamplingParams, output: list[int], suppressed: list[int]) -> np.ndarray:
    """vLLM's order on one row: allowed ids, bad words, min_tokens, logit bias (no penalties here)."""
    out = logits.astype(np.float32).copy()
    if params.allowed_token_ids is not None:
        keep = np.zeros(VOCAB, bool)
        keep[params.allowed_token_ids] = True
        out[~keep] = -np.inf
    for word in params.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            out[word[-1]] = -np.inf
    out[suppressed] = -np.inf
    for token_id, bias in (params.logit_bias or {}).items():
        out[token_id] += np.float32(bias)
    return out


def with_bad_words(params: SamplingParams, sequences: list[list[int]]) -> SamplingParams:
    """params with bad_words tokenized as `sequences` (the spaced form tokenizes the same: not added)."""
    table = dict(zip(params.bad_words, sequences))
    params.update_from_tokenizer(lambda word: table[word.strip()])
    return params


def random_case(seed: int):
    """Rows of random params (some using none of the stages) and output histories."""
    rng = np.random.default_rng(seed)
    rows, expected_inputs = [], []
    logits = rng.normal(size=(NUM_ROWS, VOCAB)).astype(np.float32) * 3
    for i in range(NUM_ROWS - 1):  # the last row is padding
        output = rng.integers(0, VOCAB, size=rng.integers(0, 6)).tolist()
        kwargs = {}
        if rng.random() < 0.6:
            ids = rng.choice(VOCAB, size=rng.integers(1, MAX_LOGIT_BIAS + 1), replace=False).tolist()
            kwargs["logit_bias"] = {t: float(rng.uniform(-100, 100)) for t in ids}
        if rng.random() < 0.4:
            kwargs["allowed_token_ids"] = rng.choice(VOCAB, size=rng.integers(1, 12), replace=False).tolist()
        sequences = []
        if rng.random() < 0.6:
            # Sequences that end the history (so they match) and random ones (which mostly do not).
            for _ in range(rng.integers(1, 4)):
                n = int(rng.integers(1, MAX_BAD_WORD_TOKENS + 1))
                tail = output[len(output) - (n - 1):] if 0 < n - 1 <= len(output) else []
                prefix = tail if tail and rng.random() < 0.7 else rng.integers(0, VOCAB, size=n - 1).tolist()
                sequences.append(prefix + [int(rng.integers(0, VOCAB))])
            kwargs["bad_words"] = [f"w{k}" for k in range(len(sequences))]
        params = SamplingParams(temperature=0.0, **kwargs)
        if sequences:
            with_bad_words(params, sequences)
        suppressed = rng.choice(VOCAB, size=2, replace=False).tolist() if rng.random() < 0.3 else []
        rows.append(SamplingRow(params, i, len(output), suppressed, output_token_ids=output))
        expected_inputs.append((params, output, suppressed))
    return logits, rows, expected_inputs


def device_tensors(rows):
    """The step's view: built on the host, the newest output token filled in on the device."""
    t = jax.tree.map(jnp.asarray, build_sampling_tensors(rows, NUM_ROWS))
    newest = jnp.asarray([row.output_token_ids[-1] if row.output_token_ids else 0 for row in rows]
                         + [0] * (NUM_ROWS - len(rows)), jnp.int32)
    return bad_words.with_newest_output_tokens(t, newest)


@pytest.mark.parametrize("seed", range(6))
def test_logits_stages_equal_the_numpy_reference(seed):
    logits, rows, inputs = random_case(seed)
    got = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), device_tensors(rows), init_penalty_state(1, VOCAB)))
    for i, (params, output, suppressed) in enumerate(inputs):
        np.testing.assert_array_equal(got[i], reference(logits[i], params, output, suppressed), err_msg=f"row {i}")
    np.testing.assert_array_equal(got[NUM_ROWS - 1], logits[NUM_ROWS - 1])  # padding row untouched


def test_random_rows_only_draw_allowed_tokens_and_greedy_follows_the_bias():
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (NUM_ROWS, VOCAB))) * 2
    allowed = [3, 9, 27]
    rows = [SamplingRow(SamplingParams(temperature=1.0, allowed_token_ids=allowed), 7, c) for c in range(NUM_ROWS - 1)]
    rows.append(SamplingRow(SamplingParams(temperature=0.0, logit_bias={5: 100.0}), 0, 0))
    tokens = np.asarray(jax.jit(sample)(jnp.asarray(logits), device_tensors(rows), init_penalty_state(1, VOCAB)).token_ids)
    assert set(tokens[:-1].tolist()) <= set(allowed)
    assert tokens[-1] == 5


def test_a_one_token_bad_word_is_always_banned_and_a_longer_one_only_after_its_prefix():
    logits = np.zeros((NUM_ROWS, VOCAB), np.float32)
    params = with_bad_words(SamplingParams(temperature=0.0, bad_words=["a", "b"]), [[4], [7, 8, 9]])
    rows = [SamplingRow(params, 0, len(out), output_token_ids=out) for out in ([], [7], [1, 7, 8], [7, 8, 1])]
    got = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), device_tensors(rows), init_penalty_state(1, VOCAB)))
    assert [np.flatnonzero(np.isinf(got[i])).tolist() for i in range(len(rows))] == [[4], [4], [4, 9], [4]]


@pytest.mark.parametrize("params", [
    SamplingParams(logit_bias={3: 1.0}),
    SamplingParams(allowed_token_ids=[3]),
    with_bad_words(SamplingParams(bad_words=["x"]), [[3]]),
])
def test_the_sharded_sampler_takes_whole_rows_for_each_new_stage(params):
    plain = build_sampling_tensors([SamplingRow(SamplingParams(temperature=0.0), 0, 0)], 2)
    assert not bool(needs_whole_rows(plain, None))
    assert bool(needs_whole_rows(build_sampling_tensors([SamplingRow(params, 0, 0)], 2), None))


def test_bad_words_are_tokenized_as_vllm_does():
    """With and without a leading space; the spaced form only when it is a different sequence of the
    same length (vLLM's SamplingParams.update_from_tokenizer)."""
    vocabulary = {"cat": [10], " cat": [11], "hot dog": [12, 13], " hot dog": [14, 15, 16], "x": [20], " x": [20]}
    params = SamplingParams(bad_words=["  cat", "hot dog", "x"])
    params.update_from_tokenizer(vocabulary.__getitem__)
    assert params.bad_words_token_ids == [[10], [11], [12, 13], [20]]


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}},
     rf"{MAX_LOGIT_BIAS + 1} logit_bias entries given; the sampler holds at most {MAX_LOGIT_BIAS} per request"),
    ({"logit_bias": {-1: 1.0}}, r"token ids of logit_bias must be >= 0, got -1"),
    ({"logit_bias": {1: float("nan")}}, r"logit_bias\[1\] must be a finite number"),
    ({"allowed_token_ids": []}, r"allowed_token_ids is empty"),
    ({"bad_words": "cat"}, r"bad_words must be a list of non-blank strings"),
])
def test_bad_values_are_refused_naming_the_value_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_and_long_bad_words_are_refused():
    with pytest.raises(ValueError, match=r"token id\(s\) \[40\] in allowed_token_ids are outside the vocabulary \[0, 40\)"):
        SamplingParams(allowed_token_ids=[1, 40]).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match=rf"are {MAX_BAD_WORD_TOKENS + 1} tokens; at most {MAX_BAD_WORD_TOKENS}"):
        SamplingParams(bad_words=["long"]).update_from_tokenizer(lambda word: list(range(MAX_BAD_WORD_TOKENS + 1)))
