"""What the engine tests share: the tiny engine's options, transformers' greedy reference, a compile counter."""

from __future__ import annotations

import jax
import numpy as np
import torch
from helpers_hf import load_hf_model

MAX_MODEL_LEN = 128
# float32 as the transformers reference (dtype "auto" is bfloat16 on a GPU, as in vLLM).
ENGINE_OPTIONS = dict(
    max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, block_size=8, num_kv_blocks=80,
    dtype="float32",
)


def hf_greedy(hf_dir, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by transformers, one full forward per token (no KV cache, no shortcuts)."""
    model = load_hf_model(hf_dir)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def random_prompts(seed: int, lengths: list[int], vocab: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]



class CompileCounter:
    """Counts XLA backend compiles while armed (jax.monitoring has no unregister, so arm/disarm)."""

    def __init__(self):
        self.armed, self.count = False, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.armed and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = CompileCounter()
