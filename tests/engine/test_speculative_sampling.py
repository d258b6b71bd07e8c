"""Sampling with speculation is lossless, end to end (issue 37): on a 12-token vocabulary the engine's
seeded samples with n-gram drafts at temperature 1 are distributed as the target model's own
distribution, which transformers computes independently, in float64, for every prefix.

Each request samples 4 tokens after one prompt: the first in its prefill step (no drafts yet), each
later one in a verification step as an accepted draft, a token resampled from the residual where a
draft was rejected, or the bonus token after every draft of the step was accepted. The prompt is the
model's own greedy continuation, so the drafts (what followed earlier occurrences of the latest
tokens) are often, not always, what the model samples: the engine's counters show all three kinds.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import hf_greedy
from helpers_hf import load_hf_model, make_tiny_hf_model
from tokenizers import Tokenizer, models, pre_tokenizers

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.convert import convert_checkpoint

VOCAB = 12
NUM_REQUESTS = 4000
MAX_TOKENS = 4
K = 2  # drafts per verification: after the prefill's token, 2 drafts and the bonus fill the 4 tokens
# Each chi-square test fails a correct engine with probability 1e-6 (and the seeds fix its samples).
P_VALUE = 1e-6


def write_word_level_tokenizer(hf_dir: Path, vocab_size: int) -> None:
    """One whitespace-separated word per id ("t0" ... ), "t2" the EOS as the model's config says."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "t2", "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory) -> tuple[Path, Path]:
    """(hf_dir, checkpoint) of a 12-token llama whose weights (std 0.5) give peaked next-token
    distributions: its greedy continuation is likely, not certain."""
    root = tmp_path_factory.mktemp("tiny-vocab")
    hf_dir = make_tiny_hf_model(root, "llama", vocab_size=VOCAB, weight_std=0.5, seed=2)
    write_word_level_tokenizer(hf_dir, VOCAB)
    return hf_dir, convert_checkpoint(hf_dir, root / "ckpt", None)


def target_distribution(hf_dir: Path, prompt: list[int], num_tokens: int) -> np.ndarray:
    """P(the first num_tokens sampled tokens) [VOCAB] * num_tokens, float64: the product of
    transformers' softmax of the logits after the prompt and after each prefix of sampled tokens."""
    prefixes = np.array(list(itertools.product(range(VOCAB), repeat=num_tokens - 1)))
    token_ids = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
    with torch.no_grad():
        logits = load_hf_model(hf_dir)(torch.tensor(token_ids)).logits[:, -num_tokens:].double()
    # conditional[t1, ..., t(n-1), j] = P(token j+1 | prompt, t1 ... tj) [VOCAB]
    conditional = torch.softmax(logits, -1).numpy().reshape((VOCAB,) * (num_tokens - 1) + (num_tokens, VOCAB))
    joint = np.ones(())
    for j in range(num_tokens):
        # causal: position j's logits do not depend on the prefix tokens after the j-th (index 0 there)
        joint = joint[..., None] * conditional[(slice(None),) * j + (0,) * (num_tokens - 1 - j) + (j,)]
    return joint


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of counts [cells] against as many draws from probs [cells]: the probability of a
    statistic this large. Cells expected fewer than 5 times are pooled into one (Cochran's rule), so
    the chi-square distribution holds."""
    expected = counts.sum() * probs
    small = expected < 5
    observed, expected = counts[~small], expected[~small]
    if small.any():
        observed = np.append(observed, counts[small].sum())
        expected = np.append(expected, counts.sum() * probs[small].sum())
    statistic = ((observed - expected) ** 2 / expected).sum()
    # the chi-square survival function: the regularized upper incomplete gamma function
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_tokens_with_ngram_drafts_are_distributed_as_the_target(tiny_vocab):
    hf_dir, checkpoint = tiny_vocab
    prompt = [3] + hf_greedy(hf_dir, [3], 19)
    # 4 rows (speculation stays on up to disable_by_batch_size 4) and 12-token steps: four compiled
    # steps, the decode, 1 and 2 requests verifying, and 12 tokens (prompt chunks, up to 4 verifying).
    llm = LLM(str(checkpoint), max_num_seqs=4, max_model_len=32, max_num_batched_tokens=12, block_size=8,
              num_kv_blocks=24, dtype="float32",  # max_logprobs 20 > VOCAB: capped to the vocabulary
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "disable_by_batch_size": 4})
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
              for seed in range(NUM_REQUESTS)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_REQUESTS, params, use_tqdm=False)
    samples = np.array([output.outputs[0].token_ids for output in outputs])
    assert samples.shape == (NUM_REQUESTS, MAX_TOKENS)

    stats = llm.get_stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    # A rejection ends its step's run, so rejections number at least (drafted - accepted) / K (about
    # half the first drafts are rejected); position 2's acceptances (both drafts kept) are the
    # verifications that sampled a bonus token after two drafts.
    assert stats["spec_decode_num_drafts"] > NUM_REQUESTS
    assert (drafted - accepted) / K > NUM_REQUESTS / 5
    assert stats["spec_decode_num_accepted_tokens_per_pos"][1] > NUM_REQUESTS / 5

    probs = target_distribution(hf_dir, prompt, MAX_TOKENS)
    for j in range(1, MAX_TOKENS + 1):  # the first token alone, then with each later one
        first_j = probs.sum(axis=tuple(range(j, MAX_TOKENS)))
        counts = np.bincount(np.ravel_multi_index(samples[:, :j].T, first_j.shape), minlength=first_j.size)
        p_value = chi_square_p_value(counts, first_j.ravel())
        total_variation = 0.5 * np.abs(counts / NUM_REQUESTS - first_j.ravel()).sum()
        assert p_value > P_VALUE, f"the first {j} tokens: p = {p_value:.2e}, total variation {total_variation:.4f}"
