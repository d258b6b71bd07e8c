"""End to end through LLM: prompt logprobs and penalties against transformers, chunked and preempted.

prompt_logprobs follow vLLM: None for the first prompt position, then per position the prompt
token (its logprob and true rank) and the top N ranked 1..N. Penalties follow vLLM's formulas
(repetition over prompt and output, frequency and presence over output), applied by hand to
transformers' logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_hf import hf_logits
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams

ENGINE_OPTIONS = dict(max_num_seqs=4, max_model_len=128, block_size=8, num_kv_blocks=80, dtype="float32")
LENGTHS = [9, 17, 40, 70]
NUM_TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("prompt-logprobs"), "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 300, size=n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def unchunked(tiny):
    return LLM(str(tiny[1]), **ENGINE_OPTIONS, enable_chunked_prefill=False, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def tiny_chunks(tiny):
    """8-token prompt chunks, and a pool of 17 blocks that forces preemptions."""
    return LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(num_kv_blocks=18)), max_num_batched_tokens=8)


def hf_log_softmax(hf_dir, token_ids: list[int]) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(hf_logits(hf_dir, token_ids)).double(), -1).numpy()


def generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def check_prompt_logprobs(hf_dir, prompt: list[int], got: list) -> None:
    ref = hf_log_softmax(hf_dir, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        row, token, entry = ref[position - 1], prompt[position], got[position]
        top = np.argsort(-row)[:NUM_TOP].tolist()
        assert list(entry)[0] == token  # the prompt token first, as vLLM
        assert set(entry) == {token, *top}
        assert entry[token].rank == int(np.sum(row >= row[token]))
        for rank, top_id in enumerate(top, start=1):
            if top_id != token:
                assert entry[top_id].rank == rank
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token_id], abs=1e-4)


def test_prompt_logprobs_match_transformers_unchunked(tiny, unchunked, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=NUM_TOP)
    outs = generate(unchunked, prompts, params)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(tiny[0], prompt, out.prompt_logprobs)
    assert generate(unchunked, [[5]], params)[0].prompt_logprobs == [None]
    assert generate(unchunked, prompts[:1], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_prompt_logprobs_are_the_same_in_8_token_chunks_under_preemption(tiny, tiny_chunks, unchunked, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=NUM_TOP)
    chunked = generate(tiny_chunks, prompts, params)
    assert tiny_chunks.get_stats()["num_preemptions"] > 0
    whole = generate(unchunked, prompts, params)
    for prompt, got, want in zip(prompts, chunked, whole):
        check_prompt_logprobs(tiny[0], prompt, got.prompt_logprobs)
        for got_entry, want_entry in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert {t: lp.rank for t, lp in got_entry.items()} == {t: lp.rank for t, lp in want_entry.items()}
            assert [lp.logprob for lp in got_entry.values()] == pytest.approx(
                [lp.logprob for lp in want_entry.values()], abs=1e-5)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("value", [21, -1, 2.0])
def test_prompt_logprobs_outside_0_to_max_are_refused_naming_the_range(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be (in \[0, 20\]|an int).*" + str(value)):
        SamplingParams(prompt_logprobs=value)


def penalised_greedy(hf_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding over transformers' logits with vLLM's penalty formulas applied by hand."""
    output: list[int] = []
    for _ in range(params.max_tokens):
        logits = hf_logits(hf_dir, prompt + output)[-1].astype(np.float64)
        seen = np.zeros(len(logits), bool)
        seen[prompt + output] = True
        logits = np.where(seen, np.where(logits > 0, logits / params.repetition_penalty,
                                         logits * params.repetition_penalty), logits)
        counts = np.bincount(output, minlength=len(logits))
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        output.append(int(np.argmax(logits)))
    return output


def test_penalised_greedy_matches_the_reference_chunked_and_preempted(tiny, tiny_chunks, prompts):
    penalised = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.8),
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=0.6,
                                presence_penalty=0.4),
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=0.7,
                                presence_penalty=-0.5)]
    before = tiny_chunks.get_stats()["num_preemptions"]
    outs = generate(tiny_chunks, prompts, penalised)
    assert tiny_chunks.get_stats()["num_preemptions"] > before
    for prompt, params, out in zip(prompts, penalised, outs):
        assert out.outputs[0].token_ids == penalised_greedy(tiny[0], prompt, params)
    # the penalties changed the answers (else the test could not fail)
    plain = generate(tiny_chunks, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]
    assert tiny_chunks.get_stats()["kv_blocks_free"] == tiny_chunks.get_stats()["kv_blocks_total"]
    assert tiny_chunks.llm_engine.runner.slots.num_held == 0


def test_aborted_and_finished_requests_give_back_their_slots(unchunked, prompts):
    engine = unchunked.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=1.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"slot-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        engine.step()
    assert engine.runner.slots.num_held == len(prompts)
    engine.abort_request("slot-1")
    engine.abort_request("slot-3")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finished[f"slot-{i}"].outputs[0].finish_reason for i in range(4)] == ["length", "abort", "length", "abort"]
    assert engine.runner.slots.num_held == 0
