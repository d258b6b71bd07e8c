"""quantization="int8" on the real SmolLM2-135M-Instruct: perplexity on a held-out English text.

The text ships with the OS, not with cbjax: Debian's GPL-3 and GFDL-1.3 (English prose never written for this
test), of which the first 20 windows of 512 SmolLM2 tokens are scored (10,220 predictions). The int8 engine
scores them with prompt_logprobs (the logprob of every real next token); the float model's perplexity is
transformers' own, in float32, on the same windows (an independent reference: no cbjax code computes it).
Issue 38's bound: int8 (per output channel) within 1% of the float model (measured +0.45%).

int4 is not scored here. Its bound (5%) says little on this model either way: SmolLM2's shipped float weights
are the dequantized Q4_1 file, 4-bit values in groups of 32 with a scale and a min, so int4-g32 finds their own
grid and scores +0.00%, while in groups of 64 (its 576-wide inputs do not divide into the default 128) it loses
about 30%. Both were measured with this test's windows; the second engine cost the suite another minute.
`python -m benchmarks.quantization` scores every quantization over 1024-token windows, with greedy agreement;
tests/models/test_int4_engine.py checks the int4 path's tokens against transformers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_hf import load_hf_model

from cbjax import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "checkpoints" / "smollm2-135m-instruct"  # scripts/fetch_model.sh makes both
HF_DIR = ROOT / "downloads" / "smollm2-135m-instruct-hf"
TEXTS = [Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/GFDL-1.3")]
WINDOW, NUM_WINDOWS = 512, 20  # 20 x 511 = 10,220 scored tokens: the issue's floor is 10k
BOUNDS = {"int8": 0.01}  # relative perplexity increase over the float model allowed


def engine_perplexity(quantization: str, windows: list[list[int]]) -> float:
    # One request at a time: each step is one 512-token window (max_tokens=1 samples in the prompt's own step).
    llm = LLM(str(CHECKPOINT), dtype="float32", quantization=quantization, max_num_seqs=1, max_model_len=WINDOW + 8,
              max_num_batched_tokens=WINDOW)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)
    scored = [entry[token].logprob for w, out in zip(windows, outputs) for token, entry in zip(w[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(scored) / len(scored))


def transformers_perplexity(windows: list[list[int]]) -> float:
    model = load_hf_model(HF_DIR)
    nll = []
    with torch.no_grad():
        for w in windows:
            logprobs = torch.log_softmax(model(torch.tensor([w])).logits[0].double(), dim=-1)
            nll.extend((-logprobs[np.arange(len(w) - 1), w[1:]]).tolist())
    return math.exp(sum(nll) / len(nll))


def test_int8_perplexity_stays_within_the_issues_bound_of_the_float_model():
    if not (CHECKPOINT / "config.json").exists() or not (HF_DIR / "config.json").exists():
        pytest.skip(f"{CHECKPOINT} or {HF_DIR} is missing; run scripts/fetch_model.sh")
    if not all(text.exists() for text in TEXTS):
        pytest.skip(f"the held-out texts {[str(t) for t in TEXTS]} are not on this machine (Debian's base-files ships them)")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(HF_DIR / "tokenizer.json"))
    ids = tokenizer.encode("\n\n".join(text.read_text() for text in TEXTS), add_special_tokens=False).ids
    windows = [ids[start : start + WINDOW] for start in range(0, WINDOW * NUM_WINDOWS, WINDOW)]
    assert all(len(w) == WINDOW for w in windows), len(ids)
    reference = transformers_perplexity(windows)
    assert 1.5 < reference < 50, reference  # an English text under a trained model, not noise (~vocab) or a leak (~1)
    for quantization, bound in BOUNDS.items():
        value = engine_perplexity(quantization, windows)
        print(f"{quantization}: perplexity {value:.4f} against the float model's {reference:.4f} "
              f"({value / reference - 1:+.2%}) over {NUM_WINDOWS * (WINDOW - 1)} tokens")
        assert value <= reference * (1 + bound), (quantization, value, reference)
