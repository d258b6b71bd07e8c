"""Speculative decoding (issue 37) is exact: greedy output with n-gram or suffix drafts is token for
token the output without them (the shared tiny engine, speculation off, is the expectation), with
chunked prefill, preemption and an abort in the mix, and stops inside a verified run cut where
decoding one token at a time stops.

One engine with speculation (k=4 compiled; the k=2 cases draft at most 2 of its 4 slots) serves
every case: its proposer is swapped per case, which is host state only (a draft model's own pool
and programs come with it).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from engine_helpers import COMPILES, ENGINE_OPTIONS, random_prompts
from helpers_hf import hf_logits, make_tiny_hf_model
from tiny_llm import llm, tiny  # noqa: F401

from cbjax import LLM, SamplingParams
from cbjax.config import EngineConfig
from cbjax.core.request import Request
from cbjax.core.spec.config import SpeculativeConfig
from cbjax.worker.spec.draft_model import DraftModelProposer
from cbjax.worker.spec.drafter import Drafter

REPO = Path(__file__).resolve().parents[2]
K = 4


def repeating_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (drafts get accepted), longer than a step's 16 tokens (chunked
    prefill), and one random."""
    bases = random_prompts(7, [5, 7, 3, 6])
    prompts = [(base * 12)[:length] for base, length in zip(bases, [23, 45, 17, 30])]
    return prompts + random_prompts(8, [19])


@pytest.fixture(scope="module")
def spec_llm(tiny) -> LLM:  # noqa: F811
    # 19 usable blocks of 8 tokens for 5 requests of up to 85 tokens: they preempt each other. Steps of
    # 16 tokens: two compiled steps (decode, mixed), every prompt chunked.
    # Started as a user would with a draft model, the target as its own draft (build_worker loads and
    # compiles it); the other cases swap their proposer in, use_draft_model puts it back.
    options = {**ENGINE_OPTIONS, "num_kv_blocks": 20, "max_num_batched_tokens": 16}
    llm = LLM(str(tiny[1]), **options, speculative_config={"model": str(tiny[1]), "num_speculative_tokens": K})
    llm.self_draft = llm.llm_engine.core.speculation.drafter
    return llm


def use_drafter(llm: LLM, method: str, k: int) -> None:
    llm.llm_engine.core.speculation.drafter = Drafter(SpeculativeConfig.of(
        {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
         "suffix_decoding_max_tree_depth": 8}))


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], abort: str | None = None):
    """Every request's final output by id; `abort` is aborted after the engine's fourth step."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        steps += 1
        if steps == 4 and abort is not None:
            engine.abort_request(abort)
    return outputs


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=i % 2 == 0, min_tokens=3 * (i == 3))
            for i in range(5)]


@pytest.mark.parametrize("method, k", [("ngram", 2), ("ngram", 4), ("suffix", 2), ("suffix", 4)])
def test_greedy_with_speculation_equals_without(llm, spec_llm, method, k):  # noqa: F811
    prompts, params = repeating_prompts(), greedy_params()
    want = run(llm, prompts, params)
    use_drafter(spec_llm, method, k)
    before = spec_llm.get_stats()
    got = run(spec_llm, prompts, params, abort="2")
    stats = spec_llm.get_stats()
    for request_id in ("0", "1", "3", "4"):
        assert got[request_id].outputs[0].token_ids == want[request_id].outputs[0].token_ids, request_id
        assert got[request_id].outputs[0].finish_reason == want[request_id].outputs[0].finish_reason
    aborted = got["2"].outputs[0]
    assert aborted.finish_reason == "abort" and want["2"].outputs[0].token_ids[: len(aborted.token_ids)] == aborted.token_ids
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > 0 and stats["num_preemptions"] > before["num_preemptions"]
    per_pos = [a - b for a, b in zip(stats["spec_decode_num_accepted_tokens_per_pos"],
                                     before["spec_decode_num_accepted_tokens_per_pos"])]
    assert sum(per_pos) == accepted and not any(per_pos[k:])  # a k=2 drafter fills 2 of the 4 slots at most
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # preempted, aborted, finished: every block back


def test_speculation_switches_off_above_disable_by_batch_size_and_on_again(llm, spec_llm, monkeypatch):  # noqa: F811
    """With 2 as the limit, 4 requests decode without drafts (async scheduling overlapping steps) until
    two of them end, then the other two speculate: the output is still the output without speculation."""
    prompts = repeating_prompts()[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 40, 12, 40)]
    want = run(llm, prompts, params)
    use_drafter(spec_llm, "ngram", K)
    core = spec_llm.llm_engine.core
    monkeypatch.setattr(core.speculation, "disable_by_batch_size", 2)
    monkeypatch.setattr(core.scheduler, "max_spec_batch_size", 2)
    verified_batches = []
    schedule = core.scheduler.schedule
    monkeypatch.setattr(core.scheduler, "schedule", lambda: (output := schedule(), verified_batches.append(
        (len(output.scheduled), bool(output.spec_token_ids))))[0])
    got = run(spec_llm, prompts, params)
    assert [got[i].outputs[0].token_ids for i in "0123"] == [want[i].outputs[0].token_ids for i in "0123"]
    assert any(speculated for _, speculated in verified_batches)
    assert all(rows <= 2 for rows, speculated in verified_batches if speculated)


def test_requests_that_do_not_speculate_share_its_steps_unchanged(llm, spec_llm):  # noqa: F811
    """Logprobs and penalties are not speculated: such requests decode one token a step beside rows
    that verify drafts, with the tokens and logprobs they get without speculation."""
    prompts = repeating_prompts()[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    want = run(llm, prompts, params)
    use_drafter(spec_llm, "ngram", K)
    before = spec_llm.get_stats()["spec_decode_num_accepted_tokens"]
    got = run(spec_llm, prompts, params)
    assert spec_llm.get_stats()["spec_decode_num_accepted_tokens"] > before
    for i in "0123":
        assert got[i].outputs[0].token_ids == want[i].outputs[0].token_ids, i
    for mine, theirs in zip(got["1"].outputs[0].logprobs, want["1"].outputs[0].logprobs):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)


def first_stop_inside_a_run(tokenizer, output: list[int], runs: list[tuple[int, list[int]]]) -> str:
    """A stop string whose first occurrence in `output`'s text is completed by the first token of a
    verified run of several tokens (runs: (output index of its first token, its tokens))."""
    for index, run in runs:
        for start in range(index, -1, -1):
            stop = tokenizer.decode(output[start : index + 1])
            if stop.strip() and stop not in tokenizer.decode(output[:index]) and stop in tokenizer.decode(output[: index + 1]):
                if len(run) > 1:
                    return stop
                break
    raise AssertionError(f"no verified run of several tokens in {runs}")


def test_stop_strings_and_stop_tokens_inside_verified_runs_cut_exactly(llm, spec_llm, monkeypatch):  # noqa: F811
    prompt = {"prompt_token_ids": repeating_prompts()[1]}
    use_drafter(spec_llm, "ngram", K)
    scheduler, runs = spec_llm.llm_engine.core.scheduler, []
    append_run = scheduler._append_run
    monkeypatch.setattr(scheduler, "_append_run",
                        lambda request, run: (runs.append((request.num_output_tokens, list(run))), append_run(request, run))[1])
    free = spec_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    stop = first_stop_inside_a_run(llm.get_tokenizer(), free[0].outputs[0].token_ids, runs)
    looped = Counter(free[0].outputs[0].token_ids[10:]).most_common(1)[0][0]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[looped], min_tokens=12)]
    want = llm.generate([prompt, prompt], params, use_tqdm=False)
    cuts = []
    truncate = Request.truncate_output
    monkeypatch.setattr(Request, "truncate_output", lambda self, n: (cuts.append(self.num_output_tokens - n), truncate(self, n))[1])
    got = spec_llm.generate([prompt, prompt], params, use_tqdm=False)
    for mine, theirs in zip(got, want):
        mine, theirs = mine.outputs[0], theirs.outputs[0]
        assert (mine.token_ids, mine.text, mine.finish_reason, mine.stop_reason) == (
            theirs.token_ids, theirs.text, theirs.finish_reason, theirs.stop_reason)
    assert want[0].outputs[0].stop_reason == stop and want[1].outputs[0].stop_reason == looped
    assert cuts and cuts[0] > 0  # the stop string ended it inside a run: the run's later tokens were dropped


def test_seeded_sampled_request_is_reproducible_and_nothing_compiles(spec_llm):
    use_drafter(spec_llm, "ngram", K)
    prompts = [{"prompt_token_ids": p} for p in repeating_prompts()[:3]]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=24, ignore_eos=True) for s in (1, 2, 3)]
    COMPILES.armed = True
    try:
        first = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        COMPILES.armed = False
    assert first == again and COMPILES.count == 0


SMOLLM2 = Path(os.environ.get("CBJAX_SMOLLM2_CHECKPOINT", REPO / "checkpoints" / "smollm2-135m-instruct"))


@pytest.mark.skipif(not (SMOLLM2 / "params").is_dir(), reason=f"no converted SmolLM2 at {SMOLLM2}")
def test_greedy_on_smollm2_equals_without_speculation():
    # One engine (one compile): the expectation is its own decoding with speculation switched off.
    options = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16, dtype="float32")
    spec = LLM(str(SMOLLM2), **options, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                           "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    text = "The quick brown fox jumps over the lazy dog. " * 2
    prompts = [f"Repeat this text exactly: {text}\n{text[:30]}", "Count: 1, 2, 3, 4, 5, 6, 7, 8,"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert spec.get_stats()["spec_decode_num_accepted_tokens"] > 0
    core = spec.llm_engine.core
    core.speculation.disable_by_batch_size = core.scheduler.max_spec_batch_size = 0  # speculation off
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == got


def test_a_front_end_in_another_process_cuts_a_run_at_its_stop_string(tiny):  # noqa: F811
    """Made by hand, the message of a step in which "x" verified a run of three tokens: the engine-core
    process's front end appends all three, and a stop string the second completes ends the output there."""
    from cbjax.core.protocol import empty_progress
    from cbjax.engine.frontend import Frontend
    from cbjax.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny[1])
    texts = {i: tokenizer.decode([i]) for i in range(40, 120)}
    first, second, third = list({text: i for i, text in texts.items() if text.strip()}.values())[:3]  # distinct texts
    stops = []
    frontend = Frontend(tokenizer, [2], stops.append)
    frontend.add_request("x", [5, 6], SamplingParams(temperature=0.0, max_tokens=9, stop=[texts[second]]), 0.0, None)
    progress = empty_progress({})
    progress.row_ids, progress.token_ids, progress.runs = ["x"], [third], {0: [first, second, third]}
    (output,) = frontend.outputs(frontend.apply(progress))
    assert output.finished and output.outputs[0].token_ids == [first, second] and stops == ["x"]
    assert output.outputs[0].stop_reason == texts[second] and output.outputs[0].text == texts[first]


# ---- method "draft_model": the same engine, a draft model as its proposer ----------------------------


def use_draft_model(llm: LLM, model_dir: Path | None) -> DraftModelProposer:
    """The engine's proposer replaced by a draft model, built and compiled as build_worker does (None:
    the one the engine was started with)."""
    core = llm.llm_engine.core
    if model_dir is None:
        core.speculation.drafter = llm.self_draft
        return llm.self_draft
    spec = SpeculativeConfig.of({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K})
    drafter = DraftModelProposer(spec, core.config, core.model_config.vocab_size, dtype="float32",
                                 activation_dtype="float32")
    drafter.precompile(progress=False)
    core.speculation.drafter = drafter
    return drafter


@pytest.fixture(scope="module")
def layer_skip_draft(tiny, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811
    """(hf_dir, checkpoint) of a smaller draft with the target's vocabulary: the tiny target without its
    last layer (it agrees with the target on some tokens, not all)."""
    import transformers
    from cbjax.checkpoint.convert import convert_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[0])
    del model.model.layers[1:]
    model.config.num_hidden_layers = 1
    root = tmp_path_factory.mktemp("layer-skip-draft")
    model.save_pretrained(root / "hf")
    return root / "hf", convert_checkpoint(root / "hf", root / "ckpt", None)


def draft_model_counters(llm: LLM) -> tuple[int, int, int]:
    stats = llm.get_stats()
    return stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"], stats["num_preemptions"]


@pytest.mark.parametrize("draft", ["target", "layer_skip"])
def test_draft_model_greedy_equals_without_and_frees_every_draft_block(llm, spec_llm, tiny, layer_skip_draft, draft):  # noqa: F811
    """Chunked prefill, preemption and an abort in the mix; the target as its own draft has every
    draft accepted, the smaller draft some, each its greedy continuation by transformers (its draft KV
    rolled back where the target rejected); nothing compiles while serving; no draft block stays held."""
    prompts, params = repeating_prompts(), greedy_params()
    want = run(llm, prompts, params)
    drafter = use_draft_model(spec_llm, None if draft == "target" else layer_skip_draft[1])
    proposals = []  # (the request's tokens, its drafts)
    propose = drafter.draft
    drafter.draft = lambda requests: [proposals.append((list(r.all_token_ids), d)) or d
                                      for r, d in zip(requests, propose(requests))]
    drafted, accepted, preemptions = draft_model_counters(spec_llm)
    COMPILES.armed = True
    try:
        got = run(spec_llm, prompts, params, abort="2")
    finally:
        COMPILES.armed = False
    for request_id in ("0", "1", "3", "4"):
        assert got[request_id].outputs[0].token_ids == want[request_id].outputs[0].token_ids, request_id
    aborted = got["2"].outputs[0]
    assert aborted.finish_reason == "abort" and want["2"].outputs[0].token_ids[: len(aborted.token_ids)] == aborted.token_ids
    now_drafted, now_accepted, now_preemptions = draft_model_counters(spec_llm)
    drafted, accepted = now_drafted - drafted, now_accepted - accepted
    assert COMPILES.count == 0 and now_preemptions > preemptions
    assert accepted == drafted > 0 if draft == "target" else 0 < accepted < drafted
    assert drafter.num_held_blocks == 0 and not drafter.sequences
    if draft == "layer_skip":
        for tokens, drafts in proposals[::10]:  # greedy: each draft the argmax after the tokens and drafts before it
            assert hf_logits(layer_skip_draft[0], tokens + drafts[:-1])[len(tokens) - 1 :].argmax(-1).tolist() == drafts
    stats = spec_llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_draft_model_with_another_vocabulary_a_missing_directory_or_tensor_parallel_is_refused(tiny, tmp_path):  # noqa: F811
    draft = make_tiny_hf_model(tmp_path, "llama", vocab_size=256)
    with pytest.raises(ValueError, match="has vocab_size 256; the target model has 320"):
        LLM(str(tiny[1]), **ENGINE_OPTIONS, speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"model='.*missing' is not a model directory \(no config.json\)"):
        LLM(str(tiny[1]), **ENGINE_OPTIONS, speculative_config={"method": "draft_model", "model": str(tmp_path / "missing"),
                                                                "num_speculative_tokens": 2})
    config = EngineConfig(model=str(tiny[1]), tensor_parallel_size=2, speculative_config={"model": str(tiny[1]),
                                                                                          "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'draft_model' is not supported with tensor_parallel_size=2, num_processes=1"):
        DraftModelProposer(config.speculative_config, config, 320, dtype="float32", activation_dtype="float32")
