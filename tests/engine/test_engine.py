"""End-to-end: the public API on a tiny random model, against transformers' greedy decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from engine_helpers import COMPILES, ENGINE_OPTIONS, MAX_MODEL_LEN, hf_greedy, random_prompts
from helpers_hf import load_hf_model
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine"), "llama")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[1]), **ENGINE_OPTIONS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Lengths around block and chunk boundaries; 40 and 70 are chunked (max_num_batched_tokens=32).
LENGTHS = [1, 7, 8, 9, 17, 40, 70]


@pytest.fixture(scope="module")
def expected(tiny):
    prompts = random_prompts(0, LENGTHS)
    return prompts, [hf_greedy(tiny[0], p, GREEDY.max_tokens) for p in prompts]


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_greedy_matches_transformers_one_request_at_a_time(llm, expected):
    prompts, want = expected
    for prompt, tokens in zip(prompts, want):
        (out,) = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == tokens
        assert out.outputs[0].finish_reason == "length"


def test_greedy_matches_transformers_batched_with_chunked_prefill(llm, expected):
    prompts, want = expected
    outs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.prompt_token_ids for o in outs] == prompts
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_preempted_requests_resume_identically(tiny, expected):
    prompts, want = expected
    # 17 blocks of 8 hold one max_model_len request (the null block aside) and little more.
    small = LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(num_kv_blocks=18)))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want_long = [hf_greedy(tiny[0], p, 40) for p in prompts[3:]]
    outs = small.generate(token_prompts(prompts[3:]), params, use_tqdm=False)
    assert small.get_stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want_long
    assert sum(o.metrics.num_preemptions for o in outs) == small.get_stats()["num_preemptions"]
    assert small.get_stats()["kv_blocks_free"] == small.get_stats()["kv_blocks_total"]


def test_whole_prompt_prefill_without_chunking(tiny, expected):
    prompts, want = expected
    unchunked = LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(
        enable_chunked_prefill=False, max_num_batched_tokens=128, prompt_bucket_midpoints=True)))
    outs = unchunked.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    # The 17- and 70-token prompts together (87 tokens) run in the 96-token bucket (with
    # prompt_bucket_midpoints), the midpoint of 64 and 128: its 9 padded rows change nothing.
    runner = unchunked.llm_engine.runner
    prepare, buckets_used = runner.prepare, []

    def recording_prepare(scheduled):
        bucket, inputs = prepare(scheduled)
        buckets_used.append(bucket)
        return bucket, inputs

    runner.prepare = recording_prepare
    unchunked.reset_prefix_cache()  # or both prompts would find all but a few tokens cached
    outs = unchunked.generate(token_prompts([prompts[4], prompts[6]]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[4], want[6]]
    assert buckets_used[0].num_tokens == 96


# One pool budget for the float16 and fp8 engines: the blocks each gets from it are the engine's own sizing.
KV_CACHE_MEMORY_BYTES = 1 << 20


def pool_bytes(llm) -> int:
    return sum(pages.nbytes for pages in llm.llm_engine.runner.kv_pool)


@pytest.fixture(scope="module")
def float16_kv(tiny):
    return LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(
        kv_cache_dtype="float16", num_kv_blocks=None, kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES)))


def test_float16_kv_cache_serves_with_half_the_pool_bytes(float16_kv, expected):
    prompts, want = expected
    assert all(pages.dtype == np.float16 for pages in float16_kv.llm_engine.runner.kv_pool)
    outs = float16_kv.generate(token_prompts(prompts[:3]), GREEDY, use_tqdm=False)
    # Rounding K/V to float16 may flip a near-tie late in a random tiny model, not the first tokens.
    assert [o.outputs[0].token_ids[:3] for o in outs] == [w[:3] for w in want[:3]]


def test_fp8_kv_cache_holds_twice_the_tokens_of_float16_in_the_same_bytes(tiny, float16_kv, expected):
    prompts, want = expected
    fp8 = LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(
        kv_cache_dtype="fp8", num_kv_blocks=None, kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES)))
    assert all(pages.dtype == jnp.float8_e4m3fn for pages in fp8.llm_engine.runner.kv_pool)
    fp8_blocks, float16_blocks = fp8.llm_engine.runner.num_blocks, float16_kv.llm_engine.runner.num_blocks
    assert fp8_blocks // 2 == float16_blocks, f"{fp8_blocks} fp8 blocks against {float16_blocks} float16 ones"
    assert pool_bytes(float16_kv) <= pool_bytes(fp8) <= KV_CACHE_MEMORY_BYTES
    outs = fp8.generate(token_prompts(prompts[:3]), GREEDY, use_tqdm=False)
    # e4m3 keeps 3 mantissa bits: a random tiny model's near-ties may flip after its first tokens.
    assert [o.outputs[0].token_ids[:2] for o in outs] == [w[:2] for w in want[:3]]
    # The 9-token prompt's first block comes back from the prefix cache as the fp8 bytes written for it.
    (again,) = fp8.generate(token_prompts(prompts[3:4]), GREEDY, use_tqdm=False)
    (cached,) = fp8.generate(token_prompts(prompts[3:4]), GREEDY, use_tqdm=False)
    assert cached.num_cached_tokens == 8 and cached.outputs[0].token_ids == again.outputs[0].token_ids


def test_interpreted_pallas_kernels_match_transformers(tiny, expected):
    prompts, want = expected
    pallas = LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(attention_backend="pallas_interpret")))
    outs = pallas.generate(token_prompts(prompts[:4]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:4]


def test_a_kernel_build_failing_after_the_steps_were_traced_falls_back_to_jnp_attention(tiny, expected, monkeypatch):
    """On a CPU the engine traces its steps while the C++ kernel still builds (register_in_background)
    and learns how the build went only before compiling: a failure there retraces with the jnp
    attention, says why, and serves correctly."""
    import cbjax.worker.model_runner as runner_module

    monkeypatch.setattr(runner_module, "kernel_problem", lambda: "KernelBuildError: compiling paged_attention.cc failed")
    with pytest.warns(RuntimeWarning, match="compiling paged_attention.cc failed.*jnp reference"):
        fallback = LLM(str(tiny[1]), **ENGINE_OPTIONS)
    assert fallback.llm_engine.backend == "xla"
    prompts, want = expected
    outs = fallback.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


ON_CPU = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the C++ kernels are the CPU engine's")


@ON_CPU
def test_the_default_cpu_engine_serves_with_the_cpp_kernel(llm):
    # The jnp path is the fallback; its greedy tokens equal transformers' in the kernel-build test above.
    assert llm.llm_engine.backend == "cpp"


def packed_weights(llm) -> int:
    """How many of the engine's weights are packed for the CPU matmul kernel ([N / 32, K, 32])."""
    return sum(leaf.ndim == 3 for leaf in jax.tree_util.tree_leaves(llm.llm_engine.runner.weights))


@ON_CPU
def test_cpu_engine_packs_its_projections_unless_told_not_to(tiny, expected, llm):
    """On a CPU the default engine runs every projection through the packed C++ matmul (the other
    tests here check its outputs); cpu_packed_weights=False keeps XLA's dots, with the same tokens."""
    config = llm.llm_engine.model_config
    assert packed_weights(llm) == 4 * config.num_hidden_layers  # qkv (fused), o, gate_up (fused), down
    unpacked = LLM(str(tiny[1]), **(ENGINE_OPTIONS | dict(cpu_packed_weights=False)))
    assert packed_weights(unpacked) == 0
    prompts, want = expected
    outs = unpacked.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want




def test_no_compilation_while_serving(llm):
    prompts = random_prompts(1, [3, 30, 1, 64, 12, 5, 90, 2, 33])
    params = [
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=3),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, max_tokens=3, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=1, min_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=15, stop=["e"]),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=1.0, max_tokens=11),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=0),
    ]
    COMPILES.armed = True
    try:
        llm.generate(token_prompts(prompts), params, use_tqdm=False)
        llm.generate(["Once upon a time", "Paris"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        COMPILES.armed = False
    assert COMPILES.count == 0


def test_seeded_request_is_the_same_whatever_its_neighbours(llm):
    prompts = random_prompts(2, [9, 25, 4, 50, 13])
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(token_prompts(prompts[:1]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(token_prompts(prompts[1:3] + prompts[:1] + prompts[3:]), [other, other, seeded, other, other], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    # A different seed gives a different continuation (12 tokens over a 320-token vocabulary).
    reseeded = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate(token_prompts(prompts[:1]), reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_text_prompts_and_chat(llm):
    tokenizer = llm.get_tokenizer()
    (out,) = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids == tokenizer.encode("Once upon a time")
    # As in vLLM, bytes of a character that never completed are held back, not shown as U+FFFD.
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids).rstrip("\ufffd")
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert chat.prompt == "<s>user\nhi</s>\n<s>assistant\n"


def test_stop_string_truncates_the_text(llm, expected):
    prompts, want = expected
    tokenizer = llm.get_tokenizer()
    full = tokenizer.decode(want[4])
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop and full.find(stop) > 0
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop])
    (out,) = llm.generate(token_prompts([prompts[4]]), params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == full[: full.find(stop)]


def test_logprobs_are_the_raw_log_softmax(tiny, llm, expected):
    prompts, want = expected
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=4)
    (out,) = llm.generate(token_prompts([prompts[2]]), params, use_tqdm=False)
    model = load_hf_model(tiny[0])
    ids = prompts[2] + want[2][:2]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, len(prompts[2]) - 1 :], -1).numpy()
    for position, entry in enumerate(out.outputs[0].logprobs):
        top = np.argsort(-ref[position])[:4]
        assert list(entry) == top.tolist()  # greedy: the sampled token is the top one, listed first
        assert [lp.rank for lp in entry.values()] == [1, 2, 3, 4]
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[position, token], abs=1e-4)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [5, 100000]}, SamplingParams(), "outside the vocabulary"),
        ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=50), "max_tokens"),
        ({"prompt_token_ids": [5]}, SamplingParams(min_tokens=2, stop_token_ids=list(range(3, 40))), "min_tokens"),
    ],
)
def test_bad_input_is_rejected_and_the_engine_keeps_serving(llm, expected, prompt, params, message):
    prompts, want = expected
    engine = llm.llm_engine
    engine.add_request("neighbour", {"prompt_token_ids": prompts[1]}, GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("neighbour", {"prompt_token_ids": [3]}, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["neighbour"].outputs[0].token_ids == want[1]
    assert engine.get_stats()["kv_blocks_free"] == engine.get_stats()["kv_blocks_total"]


def test_fcfs_refuses_a_priority_and_leaves_the_engine_as_it_was(llm, expected):
    prompts, want = expected
    with pytest.raises(ValueError, match=r"prompt 1 of 2: priority=2 is only allowed with scheduling_policy='priority'"):
        llm.generate(token_prompts(prompts[:2]), GREEDY, use_tqdm=False, priority=[0, 2])
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="start it with scheduling_policy='priority'"):
        engine.add_request("urgent", {"prompt_token_ids": prompts[1]}, GREEDY, priority=-1)
    engine.add_request("urgent", {"prompt_token_ids": prompts[1]}, GREEDY)  # its id was not taken
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["urgent"].outputs[0].token_ids == want[1]


def test_abort_returns_partial_output_and_frees_blocks(llm, expected):
    prompts, want = expected
    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, long)
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, GREEDY)
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert 0 < len(finished["a"].outputs[0].token_ids) < 60
    assert finished["b"].outputs[0].token_ids == want[1]
    assert engine.get_stats()["kv_blocks_free"] == engine.get_stats()["kv_blocks_total"]


def test_profiled_step_scratch_does_not_depend_on_the_pool_size(llm):
    """gpu_memory_utilization sizing reserves the largest step's scratch, measured on a 2-block pool.

    On a CPU the two are equal; on the H200 (scripts/gpu_check.sh) XLA's scratch varied with the
    pool by about 5%, the 2-block probe the larger: the reservation must cover the real step."""
    from cbjax.worker.model_runner import ModelRunner

    runner = llm.llm_engine.runner
    model = nnx.merge(runner.graphdef, jax.tree_util.tree_unflatten(runner._state_treedef, runner.weights))
    probe = ModelRunner(model, runner.model_config, runner.config, 2, runner.backend)
    scratch = probe.peak_step_bytes()
    assert scratch > 0
    actual = runner.peak_step_bytes()
    assert actual <= scratch <= 1.1 * actual


def test_the_profiled_scratch_is_stored_with_the_steps(llm, tmp_path, monkeypatch):
    """A warm start on an accelerator reads the 2-block probe's scratch from the step cache instead of
    tracing and compiling the two largest steps again (scripts/gpu_check.sh counted them on an H200)."""
    import dataclasses

    from cbjax.worker.compilation.compile_cache import DISABLE_ENV
    from cbjax.worker.model_runner import ModelRunner

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    runner = llm.llm_engine.runner
    model = nnx.merge(runner.graphdef, jax.tree_util.tree_unflatten(runner._state_treedef, runner.weights))
    config = dataclasses.replace(runner.config, compilation_cache_dir=str(tmp_path))
    measured = ModelRunner(model, runner.model_config, config, 2, runner.backend).peak_step_bytes()
    assert [p.suffix for p in (tmp_path / "steps").iterdir()] == [".number"]
    again = ModelRunner(model, runner.model_config, config, 2, runner.backend)
    monkeypatch.setattr(again, "_compile", lambda bucket: pytest.fail(f"compiled {bucket} again"))
    assert again.peak_step_bytes() == measured
    # Another pool is another key: that probe measures its own steps.
    other = ModelRunner(model, runner.model_config, config, 3, runner.backend)
    assert other.peak_step_bytes() > 0 and len(list((tmp_path / "steps").iterdir())) == 2
