"""One request cannot bring the engine down (issue 35, defect 1): values the sampler's columns cannot
hold are refused when the request arrives, and a request the runner still cannot prepare fails
alone, its error to its caller, while its neighbours finish with transformers' tokens and every KV
block comes back."""

from __future__ import annotations

import pytest
from engine_helpers import hf_greedy
from failing_writer import MARKED, patch_writers
from tiny_llm import llm, tiny  # noqa: F401 (module fixtures: one tiny engine for the session)

from cbjax import SamplingParams

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 8, 61], [11, 12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def assert_everything_freed(engine) -> None:
    stats = engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "every KV block is back in the pool"
    assert not engine.runner.sampling_constants and engine.runner.slots.num_held == 0, "every request slot is free"


def run(engine) -> dict[str, list[int]]:
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    return finished


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [8589934592]),  # held back under min_tokens: an int32 column
    ("temperature", 10**400),  # not even a float
    ("logit_bias", {5: 10**400}),
])
def test_a_request_the_runner_cannot_prepare_fails_alone(llm, tiny, field, value):  # noqa: F811
    """The bad value is put in after the checks (as a bug in them would let it through): before issue
    35 the runner's OverflowError left EngineCore.step and killed the engine loop."""
    engine = llm.llm_engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"good{index}", {"prompt_token_ids": prompt}, GREEDY)
    engine.add_request("bad", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.5, min_tokens=2, max_tokens=6, n=2, seed=1))
    for child in engine.book.requests["bad"].children:  # frozen: past the checks, as only a bug would be
        object.__setattr__(child.sampling_params, field, value)
    outputs = run(engine)
    ((request_id, error),) = engine.take_failed()
    assert request_id == "bad" and isinstance(error, ValueError)
    assert "could not prepare this request" in str(error)
    assert "bad" not in outputs and "bad" not in engine.book.requests
    for index, prompt in enumerate(PROMPTS):
        assert outputs[f"good{index}"] == hf_greedy(tiny[0], prompt, 6)
    assert_everything_freed(engine)


def test_generate_fails_the_call_for_a_prompt_the_runner_cannot_prepare(llm, monkeypatch):  # noqa: F811
    """LLM.generate: a prompt whose sampling row cannot be written (one stage's writer raising, for one
    request) fails the call with its error, as a bad prompt does when it is added; nothing leaks, and
    the engine serves the next call."""
    patch_writers(monkeypatch.setattr)
    params = [GREEDY, MARKED, GREEDY]
    with pytest.raises(ValueError, match=r"prompt 1 of 3: .*OverflowError.*the call's other prompts were withdrawn"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_everything_freed(llm.llm_engine)
    monkeypatch.undo()
    (output,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 6


def test_top_k_beyond_the_vocabulary_keeps_every_token(llm):  # noqa: F811
    """vLLM clamps top_k to the vocabulary: a top_k of 3e9 or of 300 digits samples exactly as no
    top_k (the same seeded draws), where before it wrapped negative in int32 or raised in the sampler."""
    def sample(top_k):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=7, max_tokens=8, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                               use_tqdm=False)]
    unlimited = sample(0)
    assert sample(3_000_000_000) == unlimited
    assert sample(10**300) == unlimited

