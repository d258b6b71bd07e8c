"""Checkpoints with fp8 weights (checkpoint/fp8_checkpoint.py), written here as the quantizers lay them out: torch's
own float8_e4m3fn weights with their scales beside them (per output row as llm-compressor's FP8 scheme, per
tensor as AutoFP8, per block as DeepSeek-style weight_scale_inv), static input scales and a quantization_config.
The reference for each is a float32 checkpoint of torch's own dequantization, q.float() * scale: dequantized at
load (a conversion) cbjax must give the same parameters bit for bit; kept as stored (served from the directory)
the logits of those floats to float32 accumulation, and its engine transformers' greedy tokens on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from engine_helpers import ENGINE_OPTIONS, hf_greedy, random_prompts
from fp8_checkpoints import BLOCK, FORMS, write_fp8_checkpoint
from safetensors.torch import load_file, save_file
from test_packed_matmul import forward_logits
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.convert import read_hf_params
from cbjax.checkpoint.kv_scale_tensors import read_kv_scales
from cbjax.checkpoint.loader import load_model
from cbjax.checkpoint.resolve import resolve_model
from cbjax.entrypoints.cli.main import main
from cbjax.models.config import ModelConfig
from cbjax.plan.accelerators import accelerator
from cbjax.plan.capacity import FP8_AS_STORED, load_model_config, plan_capacity

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), "llama")[0]


@pytest.mark.parametrize("form", list(FORMS))
def test_fp8_weights_load_as_torchs_dequantization_bit_for_bit(tiny, tmp_path, form):
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fp8", form)
    config = ModelConfig.from_dir(tiny)
    got = read_hf_params(fp8, config, "float32", progress=False)
    want = read_hf_params(fp8.with_name("fp8-float"), config, "float32", progress=False)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not np.array_equal(want["model.layers.0.self_attn.q_proj.kernel"],
                              read_hf_params(tiny, config, "float32", progress=False)["model.layers.0.self_attn.q_proj.kernel"])


def assert_logits_of_the_float_checkpoint(fp8: Path, float_dir: Path) -> None:
    """fp8's logits (loaded as the engine loads it on one CPU: packed, q/k/v and gate/up fused) are float_dir's to
    float32 accumulation, through the C++ kernels and the jnp products."""
    stored, _ = load_model(fp8, pack_for_cpu=True, fused_projections=True)
    floats, _ = load_model(float_dir, pack_for_cpu=True, fused_projections=True)
    ids = random_prompts(6, [24])[0]
    for backend in ("cpp", "xla"):
        want = forward_logits(floats, ids, backend)
        np.testing.assert_allclose(forward_logits(stored, ids, backend), want, rtol=0, atol=2e-5 * np.abs(want).max())
    return stored


@pytest.mark.parametrize("form", list(FORMS))
def test_fp8_projections_are_kept_as_stored_and_give_the_dequantized_checkpoints_logits(tiny, tmp_path, form):
    """Served from its directory (no conversion), every projection stays e4m3 with float32 scales beside it ([out]
    per tensor or row, [in / 32, out] per block); the embedding and head stay float."""
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fp8", form)
    assert resolve_model(str(fp8)) == fp8
    stored = assert_logits_of_the_float_checkpoint(fp8, fp8.with_name("fp8-float"))
    layer = stored.model.layers[1]
    for module, k in ((layer.self_attn.qkv_proj, 64), (layer.self_attn.o_proj, 64), (layer.mlp.gate_up_proj, 64),
                      (layer.mlp.down_proj, 128)):
        assert module.kernel[...].dtype == jnp.float8_e4m3fn and module.scales[...].dtype == jnp.float32
        assert module.scales[...].shape[:-1] == ((k // BLOCK,) if form == "per-block" else ())
    assert stored.model.embed_tokens.embedding[...].dtype == jnp.float32


def leave_k_proj_float(fp8: Path) -> None:
    """k_proj of every layer float in `fp8` (as a quantizer's ignore list may leave one), its scale dropped."""
    weights, floats = load_file(fp8 / "model.safetensors"), load_file(fp8.with_name("fp8-float") / "model.safetensors")
    for layer in (0, 1):
        name = f"model.layers.{layer}.self_attn.k_proj.weight"
        weights[name] = floats[name]
        del weights[name + "_scale"]
    save_file(weights, fp8 / "model.safetensors", metadata={"format": "pt"})


def test_an_fp8_projection_whose_fused_partner_is_float_is_dequantized(tiny, tmp_path):
    """k_proj left float: q and v, fused with it, are dequantized at load; the other projections stay fp8; the
    logits are the float checkpoint's."""
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fp8", "per-row")
    leave_k_proj_float(fp8)
    stored = assert_logits_of_the_float_checkpoint(fp8, fp8.with_name("fp8-float"))
    attention, mlp = stored.model.layers[0].self_attn, stored.model.layers[0].mlp
    assert attention.qkv_proj.kernel[...].dtype == jnp.float32 and attention.o_proj.kernel[...].dtype == jnp.float8_e4m3fn
    assert mlp.gate_up_proj.kernel[...].dtype == jnp.float8_e4m3fn


def test_an_fp8_checkpoint_serves_transformers_greedy_tokens_on_its_dequantized_weights(tiny, tmp_path):
    """LLM(model=<fp8 checkpoint>) as vLLM takes one (its projections kept fp8), its KV-cache scales beside
    (llm-compressor's names)."""
    layers = ModelConfig.from_dir(tiny).num_hidden_layers
    kv = {f"model.layers.{i}.self_attn.{kind}": torch.tensor(0.05) for i in range(layers) for kind in ("k_scale", "v_scale")}
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fp8", "per-row", kv)
    assert read_kv_scales(fp8, layers) == [(np.float32(0.05), np.float32(0.05))] * layers
    prompts = random_prompts(5, [6, 13])
    outs = LLM(str(fp8), **ENGINE_OPTIONS).generate([{"prompt_token_ids": p} for p in prompts],
                                                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                                     use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(fp8.with_name("fp8-float"), prompt, 8)


def test_fp8_checkpoints_are_not_quantized_again_and_other_methods_are_refused(tiny, tmp_path):
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fp8", "per-tensor")
    with pytest.raises(ValueError, match=r"quant_method 'fp8'\), dequantized at load; quantization='int8' would round"):
        load_model(fp8, quantization="int8")
    config = ModelConfig.from_dir(tiny)
    for quant, message in [
        ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported; cbjax loads float checkpoints"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
         r"group 'g' has 4-bit int weights"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"quant_algo 'NVFP4'"),
    ]:
        other = tmp_path / quant["quant_method"]
        shutil.copytree(tiny, other, dirs_exist_ok=True)
        (other / "config.json").write_text(json.dumps(json.loads((tiny / "config.json").read_text())
                                                      | {"quantization_config": quant}))
        with pytest.raises(ValueError, match=message):
            read_hf_params(other, config, "float32", progress=False)
    weights = load_file(fp8 / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(weights, fp8 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight is float8_e4m3fn without a scale"):
        read_hf_params(fp8, config, "float32", progress=False)


@pytest.mark.parametrize("form", ["per-row", "per-block"])
def test_every_step_of_an_fp8_checkpoint_as_stored_lowers_for_cuda(tiny, tmp_path, form, capsys):
    """On a GPU the e4m3 kernels run the jnp products (XLA converts them inside the dot): each bucket's step lowers
    for CUDA with them, without a GPU (at TP=2 too: tests/worker/test_tensor_parallel.py)."""
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fp8", form)
    main(["lower", "--platform", "cuda", "--backend", "pallas", "--model", str(fp8), "--max-num-seqs", "4",
          "--max-model-len", "64", "--max-num-batched-tokens", "32", "--block-size", "16", "--num-kv-blocks", "40"])
    assert "lowered 3/3 steps for cuda with backend pallas" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"would lower the float model .* use --model {fp8}"):
        main(["lower", "--config", str(fp8)])


@pytest.mark.parametrize("form", [*FORMS, "per-row, k_proj float"])
def test_plan_counts_an_fp8_checkpoint_as_the_loader_holds_it(tiny, tmp_path, capsys, form):
    """`cbjax plan --config <fp8 checkpoint>` at one device: exactly the bytes the loader holds (e4m3 kernels, float32
    scales [out] or per block [in / 32, out], q and v dequantized beside a float k, the rest in dtype), for every
    scale form; quantization= refused."""
    fp8 = write_fp8_checkpoint(tiny, tmp_path / "fp8", form.split(",")[0])
    if "k_proj float" in form:
        leave_k_proj_float(fp8)
    name, config = load_model_config(str(fp8))
    plan = plan_capacity(name, config, accelerator("h100"), 1, dtype="float32", fp8=fp8)
    loaded = read_hf_params(fp8, config, "float32", progress=False, keep_fp8=True)
    assert plan.quantization == FP8_AS_STORED
    assert plan.weight_bytes_per_device == sum(array.nbytes for array in loaded.values())
    main(["plan", "--config", str(fp8), "--device", "h100", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "(the checkpoint's fp8 decoder projections as stored, a byte a weight)" in out
    assert f"({plan.weight_bytes_per_device:,} bytes)" in out
    with pytest.raises(ValueError, match="holds fp8 weights, served as stored; quantization='int8' would round"):
        plan_capacity(name, config, accelerator("h100"), 1, quantization="int8", fp8=fp8)
