"""calculate_kv_scales: each layer's fp8 scales from a calibration step at start-up (worker/kv_scales.py).

The reference is transformers' own KV cache (post-RoPE K and V per layer) of the same prompts. The
engine test uses a tiny model rewritten to compute the same function with K and V 1000x larger
(k_proj and v_proj times 1000, q_proj and o_proj divided by 1000): its K and V pass e4m3's 448, so at
scale 1.0 an fp8 pool saturates them, and calibrated scales must bring it back to the float pool's answers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import ENGINE_OPTIONS
from helpers_hf import load_hf_model
from safetensors.numpy import load_file, save_file
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.convert import convert_checkpoint
from cbjax.checkpoint.kv_scale_tensors import collect_kv_scales, kv_scale_slot, read_kv_scales
from cbjax.checkpoint.loader import load_model
from cbjax.config import EngineConfig
from cbjax.models.layers.attention import AttentionPlan
from cbjax.tokenizer.tokenizer import Tokenizer
from cbjax.worker.kv_scales import (K_SCALE_CONSTANT, V_SCALE_CONSTANT, calibrate_kv_scales, calibration_prompts,
                                    kv_amax, prompt_step, scales_from_amax)

GAIN = 1000.0  # K and V this many times the random model's (about 1-4): far past e4m3's 448


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(hf_dir, checkpoint, loud checkpoint): a tiny llama as drawn (checkpoint), and the same function computed
    with K and V GAIN x larger (hf_dir, the loud checkpoint)."""
    root = tmp_path_factory.mktemp("loud-kv")
    hf_dir, checkpoint = make_tiny_checkpoint(root, "llama")
    weights = load_file(hf_dir / "model.safetensors")
    gains = {"k_proj": GAIN, "v_proj": GAIN, "q_proj": 1 / GAIN, "o_proj": 1 / GAIN}
    for name in weights:
        gain = next((g for projection, g in gains.items() if f".{projection}." in name), 1.0)
        weights[name] = (weights[name] * np.float32(gain)).astype(weights[name].dtype)
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    load_hf_model.cache_clear()
    return hf_dir, checkpoint, convert_checkpoint(hf_dir, root / "ckpt-loud", None)


def transformers_amax(hf_dir: Path, prompts: list[list[int]]) -> np.ndarray:
    """[layers, 2]: the largest |K| and |V| in transformers' KV cache over the prompts, each run alone."""
    model = load_hf_model(hf_dir)
    amax = np.zeros((model.config.num_hidden_layers, 2))
    with torch.no_grad():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            cache = out.cache if "cache" in out else out.past_key_values  # transformers 5.2x renamed it
            for index, layer in enumerate(cache.layers):
                amax[index] = np.maximum(amax[index], [float(layer.keys.abs().max()), float(layer.values.abs().max())])
    return amax


def test_prompt_step_puts_each_prompt_in_its_own_blocks_after_the_null_block():
    token_ids, positions, metadata, num_blocks = prompt_step([[7, 8, 9], [1, 2, 3, 4, 5]], block_size=4)
    assert token_ids.tolist() == [7, 8, 9, 1, 2, 3, 4, 5]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    # Prompt 0 in block 1 (slots 4-6), prompt 1 in blocks 2 and 3 (slots 8-11, then 12).
    assert metadata.slot_mapping.tolist() == [4, 5, 6, 8, 9, 10, 11, 12]
    assert metadata.query_start_loc.tolist() == [0, 3, 8]
    assert metadata.seq_lens.tolist() == [3, 5]
    assert metadata.block_tables.tolist() == [[1, 0], [2, 3]]
    assert num_blocks == 4


def test_scales_are_vllms_amax_over_200_and_100():
    scales = scales_from_amax(np.array([[20.0, 10.0], [0.0, 3.0]]))
    assert scales == [(0.1, 0.1), (1.0, 0.03)]  # an all-zero K keeps 1.0 rather than divide by 0
    with pytest.raises(ValueError, match=r"not finite in layers \[1\]"):
        scales_from_amax(np.array([[1.0, 1.0], [np.nan, 1.0]]))


@pytest.mark.parametrize("backend", ["xla", "cpp"])
def test_calibration_amax_is_transformers_kv_caches(tiny, backend):
    hf_dir, _, checkpoint = tiny
    prompts = calibration_prompts(Tokenizer.from_dir(checkpoint))
    assert len(prompts) == 6  # five texts and one chat turn (the tiny tokenizer has a template)
    cut = calibration_prompts(Tokenizer.from_dir(checkpoint), 40)  # max_model_len 40: no longer prompt
    assert cut == [prompt[:40] for prompt in prompts] and max(map(len, prompts)) > 40
    model, _ = load_model(checkpoint, dtype="float32")
    expected = transformers_amax(hf_dir, prompts)
    assert expected.min() > 448  # the premise: at scale 1.0 these would saturate
    np.testing.assert_allclose(kv_amax(model, prompts, 8, AttentionPlan(backend)), expected, rtol=1e-5)
    scales = calibrate_kv_scales(model, Tokenizer.from_dir(checkpoint), 8, AttentionPlan(backend))
    np.testing.assert_allclose(scales, expected / [K_SCALE_CONSTANT, V_SCALE_CONSTANT], rtol=1e-5)
    assert [layer.self_attn.kv_scales for layer in model.model.layers] == scales


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> np.ndarray:
    """Each prompt token's logprob given the tokens before it, all prompts back to back."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return np.array([next(iter(lp.values())).logprob for out in outs for lp in out.prompt_logprobs[1:]])


def test_calibrated_fp8_pool_gives_the_float_pools_logprobs_where_scale_1_saturates(tiny):
    _, quiet, loud = tiny
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (5, 17, 40)]
    engine = lambda checkpoint, **options: LLM(str(checkpoint), **(ENGINE_OPTIONS | options))  # noqa: E731
    reference = prompt_logprobs(engine(quiet, kv_cache_dtype="float32"), prompts)
    np.testing.assert_allclose(prompt_logprobs(engine(loud, kv_cache_dtype="float32"), prompts), reference, atol=1e-3)
    errors = {
        # e4m3's own rounding, where scale 1.0 suits the model: the bar for the calibrated loud one
        "quiet fp8": prompt_logprobs(engine(quiet, kv_cache_dtype="fp8"), prompts) - reference,
        "loud fp8, calibrated": prompt_logprobs(engine(loud, kv_cache_dtype="fp8", calculate_kv_scales=True), prompts)
        - reference,
        "loud fp8, scale 1.0": prompt_logprobs(engine(loud, kv_cache_dtype="fp8"), prompts) - reference,
    }
    mean = {name: float(np.abs(error).mean()) for name, error in errors.items()}
    print("mean |logprob error|:", {name: f"{value:.3g}" for name, value in mean.items()})
    assert mean["loud fp8, calibrated"] < 2 * mean["quiet fp8"]
    assert mean["loud fp8, scale 1.0"] > 10 * mean["loud fp8, calibrated"]


def test_calculate_kv_scales_needs_an_fp8_pool():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float16'; set kv_cache_dtype='fp8'"):
        EngineConfig(model="m", kv_cache_dtype="float16", calculate_kv_scales=True)


def test_a_draft_models_fp8_pool_is_calibrated_too(tiny):
    """speculative_config's draft model keeps its own fp8 pool: calibrated like the target's, so a draft that is
    the loud model itself proposes what the target picks (at scale 1.0 its clipped K/V would draft poorly)."""
    hf_dir, _, loud = tiny
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in np.random.default_rng(1).integers(3, 300, size=(2, 9)).tolist()]
    plain = LLM(str(loud), **ENGINE_OPTIONS, kv_cache_dtype="fp8", calculate_kv_scales=True)
    speculating = LLM(str(loud), **ENGINE_OPTIONS, kv_cache_dtype="fp8", calculate_kv_scales=True,
                      speculative_config={"model": str(loud), "num_speculative_tokens": 2})
    speculation = speculating.llm_engine.core.speculation
    expected = transformers_amax(hf_dir, calibration_prompts(Tokenizer.from_dir(loud), ENGINE_OPTIONS["max_model_len"]))
    np.testing.assert_allclose(speculation.drafter.kv_scales, expected / [K_SCALE_CONSTANT, V_SCALE_CONSTANT],
                               rtol=1e-5)
    outputs = lambda llm: [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]  # noqa: E731
    assert outputs(speculating) == outputs(plain)
    # The same model over the same scales drafts the target's tokens: 30 of 30 accepted here (the draft at scale 1.0:
    # 5 of 79).
    assert speculation.num_accepted_tokens >= 0.9 * speculation.num_draft_tokens > 0


def test_calibration_runs_the_jnp_attention_where_the_kernel_build_failed(tiny, monkeypatch):
    """Where the C++ kernel did not build, the engine serves with the jnp attention (cpu_kernel_fallback), and the
    calibration step runs there too rather than call a kernel that is not registered."""
    import cbjax.worker.build as build_module
    import cbjax.worker.model_runner as runner_module

    _, quiet, loud = tiny
    problem = lambda: "KernelBuildError: compiling paged_attention.cc failed"  # noqa: E731
    monkeypatch.setattr(build_module, "kernel_problem", problem)
    monkeypatch.setattr(runner_module, "kernel_problem", problem)
    backends = []
    calibrate = build_module.calibrate_kv_scales
    monkeypatch.setattr(build_module, "calibrate_kv_scales",
                        lambda model, tokenizer, block_size, plan, max_len: backends.append(plan.backend) or
                        calibrate(model, tokenizer, block_size, plan, max_len))
    with pytest.warns(RuntimeWarning, match="compiling paged_attention.cc failed"):
        llm = LLM(str(loud), **ENGINE_OPTIONS, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert backends == ["xla"] and llm.llm_engine.backend == "xla"
    prompts = [np.random.default_rng(2).integers(3, 300, size=12).tolist()]
    reference = prompt_logprobs(LLM(str(quiet), **ENGINE_OPTIONS, kv_cache_dtype="float32", attention_backend="xla"),
                                prompts)
    assert np.abs(prompt_logprobs(llm, prompts) - reference).mean() < 0.1


def with_scale_tensors(hf_dir: Path, out: Path, scales: dict[str, np.ndarray]) -> Path:
    """A copy of hf_dir whose safetensors hold `scales` beside its weights."""
    shutil.copytree(hf_dir, out)
    weights = load_file(out / "model.safetensors")
    save_file(weights | scales, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_checkpoint_kv_scales_are_read_under_each_quantizers_names(tiny, tmp_path):
    """llm-compressor's self_attn.k_scale / v_scale, ModelOpt's k_proj.k_scale / v_proj.v_scale and AutoFP8's one
    kv_scale give each layer's (k_scale, v_scale); weights' names are not scales; a conversion keeps them."""
    assert kv_scale_slot("model.layers.3.self_attn.k_scale") == (3, "k_scale")
    assert kv_scale_slot("model.layers.0.self_attn.v_proj.v_scale") == (0, "v_scale")
    assert kv_scale_slot("model.layers.1.self_attn.kv_scale") == (1, "kv_scale")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.v_scale",
                 "model.layers.0.self_attn.k_proj.weight_scale", "model.layers.0.mlp.k_scale"):
        assert kv_scale_slot(name) is None
    hf_dir = tiny[0]
    layers = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    assert read_kv_scales(hf_dir, layers) is None
    values = np.random.default_rng(3).uniform(0.01, 4, (layers, 2))
    forms = {
        "compressed-tensors": {f"model.layers.{i}.self_attn.{kind}": np.array(values[i, j], np.float32)
                               for i in range(layers) for j, kind in enumerate(("k_scale", "v_scale"))},
        "modelopt": {f"model.layers.{i}.self_attn.{kind}_proj.{kind}_scale": np.array([values[i, j]], np.float32)
                     for i in range(layers) for j, kind in enumerate("kv")},
        "autofp8": {f"model.layers.{i}.self_attn.kv_scale": np.array([values[i, 0]], np.float16)
                    for i in range(layers)},
    }
    for form, tensors in forms.items():
        scaled = with_scale_tensors(hf_dir, tmp_path / form, tensors)
        expected = (np.repeat(values[:, :1], 2, 1).astype(np.float16) if form == "autofp8" else values.astype(np.float32))
        np.testing.assert_array_equal(np.array(read_kv_scales(scaled, layers)), expected.astype(np.float64))
    converted = convert_checkpoint(tmp_path / "modelopt", tmp_path / "converted", None)
    assert read_kv_scales(converted, layers) == read_kv_scales(tmp_path / "modelopt", layers)


def test_checkpoint_kv_scales_that_cbjax_cannot_use_are_refused_by_name():
    scale = lambda value, shape=(): np.full(shape, value, np.float32)  # noqa: E731
    both = lambda layer: {f"model.layers.{layer}.self_attn.{kind}": scale(0.5) for kind in ("k_scale", "v_scale")}  # noqa: E731
    with pytest.raises(ValueError, match=r"self_attn.k_scale has shape \(2,\); cbjax takes one fp8 KV scale per layer"):
        collect_kv_scales({**both(0), "model.layers.0.self_attn.k_scale": scale(0.5, (2,))}, 1, "ckpt")
    with pytest.raises(ValueError, match=r"v_scale is 0.0; an fp8 KV scale must be finite and positive"):
        collect_kv_scales({**both(0), "model.layers.0.self_attn.v_scale": scale(0.0)}, 1, "ckpt")
    with pytest.raises(ValueError, match=r"but not these: 1.k_scale, 1.v_scale"):
        collect_kv_scales(both(0), 2, "ckpt")
    with pytest.raises(ValueError, match=r"is for layer 2; the model has 2 layers"):
        collect_kv_scales(both(0) | both(1) | both(2), 2, "ckpt")


def test_an_fp8_pool_takes_the_scales_its_checkpoint_carries(tiny, tmp_path):
    """A checkpoint of the loud model carrying k_scale and v_scale tensors (llm-compressor's names), here transformers'
    own max |K| / 200 and max |V| / 100 over the calibration prompts: its fp8 pool uses them, giving the prompt
    logprobs of calculate_kv_scales (which computes the same numbers) where scale 1.0 would saturate; a float pool
    leaves them unused."""
    hf_dir, _, loud = tiny
    prompts_in = calibration_prompts(Tokenizer.from_dir(loud), ENGINE_OPTIONS["max_model_len"])
    scales = transformers_amax(hf_dir, prompts_in) / [K_SCALE_CONSTANT, V_SCALE_CONSTANT]
    scaled = with_scale_tensors(hf_dir, tmp_path / "scaled", {
        f"model.layers.{i}.self_attn.{kind}": np.array(scales[i, j], np.float32)
        for i in range(len(scales)) for j, kind in enumerate(("k_scale", "v_scale"))})
    prompts = [np.random.default_rng(4).integers(3, 300, size=n).tolist() for n in (9, 30)]
    calibrated = prompt_logprobs(LLM(str(loud), **ENGINE_OPTIONS, kv_cache_dtype="fp8", calculate_kv_scales=True),
                                 prompts)
    from_checkpoint = prompt_logprobs(LLM(str(scaled), **ENGINE_OPTIONS, kv_cache_dtype="fp8"), prompts)
    np.testing.assert_allclose(from_checkpoint, calibrated, atol=1e-3)
    float_pool = prompt_logprobs(LLM(str(scaled), **ENGINE_OPTIONS, kv_cache_dtype="float32"), prompts)
    np.testing.assert_allclose(float_pool, prompt_logprobs(LLM(str(loud), **ENGINE_OPTIONS, kv_cache_dtype="float32"),
                                                           prompts), rtol=0, atol=0)
