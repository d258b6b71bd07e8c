"""The priority scheduling policy end to end: a tiny model whose KV pool cannot hold every request at once."""

from __future__ import annotations

import pytest
from engine_helpers import ENGINE_OPTIONS, hf_greedy, random_prompts
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("priority"), "llama")


def test_urgent_request_is_never_preempted_and_finishes_first(tiny):
    # 17 usable blocks of 8 (136 tokens) for 4 requests that end at 49, 57, 80 and 100 tokens: some
    # must be preempted. The urgent one comes last with the longest prompt: fcfs would admit it last
    # and preempt it first (tests/core/test_scheduling_policy.py); priority admits it first and
    # preempts only the others. Its 30 tokens to their 40 make "first" strict.
    llm = LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(num_kv_blocks=18, scheduling_policy="priority")))
    prompts = random_prompts(1, [9, 17, 40, 70])
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=[1, 1, 1, 0])

    urgent, others = outs[3], outs[:3]
    assert urgent.metrics.num_preemptions == 0
    assert sum(o.metrics.num_preemptions for o in others) == llm.get_stats()["num_preemptions"] > 0
    assert urgent.metrics.finished_time < min(o.metrics.finished_time for o in others)
    want = [hf_greedy(tiny[0], p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in outs] == want, "preempted requests resume identically"
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]

    with pytest.raises(ValueError, match=r"priority must be a list of one int per prompt \(2\)"):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[0], use_tqdm=False, priority=[0])
