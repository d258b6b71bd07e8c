"""Synthetic requests like vLLM's `random` and `prefix_repetition` datasets: random token ids, lengths
spread by a range ratio.

Lengths are uniform integers in [floor(L * (1 - r)), ceil(L * (1 + r))] (vLLM's
RandomDataset); prompt i is the run (offset_i + i + arange(len_i)) % vocab_size.
vLLM then round-trips the ids through the tokenizer to get a text prompt; here the
ids are passed as `prompt_token_ids`, so every system sees exactly the same tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class SyntheticRequest:
    prompt_token_ids: list[int]
    output_len: int  # forced with ignore_eos, max_tokens = output_len

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, size: int) -> np.ndarray:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio is {range_ratio}; it must be in [0, 1)")
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=size)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int = 0,
) -> list[SyntheticRequest]:
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    offsets = rng.integers(0, vocab_size, size=num_prompts)
    return [
        SyntheticRequest(
            prompt_token_ids=((offsets[i] + i + np.arange(input_lens[i])) % vocab_size).tolist(),
            output_len=int(output_lens[i]),
        )
        for i in range(num_prompts)
    ]


def prefix_requests(
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int = 0,
) -> list[SyntheticRequest]:
    """Prompts that share `num_prefixes` system prompts (each of about prefix_len tokens), each followed
    by its own question; every prefix serves num_prompts / num_prefixes requests, in shuffled order."""
    if not 1 <= num_prefixes <= num_prompts:
        raise ValueError(f"num_prefixes is {num_prefixes}; it must be in [1, num_prompts={num_prompts}]")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, size=n).tolist() for n in sample_lengths(rng, prefix_len, range_ratio, num_prefixes)]
    question_lens = sample_lengths(rng, question_len, range_ratio, num_prompts)
    output_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    owners = rng.permutation(np.arange(num_prompts) % num_prefixes)
    return [
        SyntheticRequest(
            prompt_token_ids=prefixes[owners[i]] + rng.integers(0, vocab_size, size=question_lens[i]).tolist(),
            output_len=int(output_lens[i]),
        )
        for i in range(num_prompts)
    ]


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s from start) like vLLM: gamma gaps with mean 1/rate (shape 1 = Poisson); inf = all at 0."""
    if math.isinf(request_rate):
        return np.zeros(num)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate ({request_rate}) and burstiness ({burstiness}) must be > 0")
    rng = np.random.default_rng(seed + 1)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    return np.cumsum(gaps) - gaps[0]
