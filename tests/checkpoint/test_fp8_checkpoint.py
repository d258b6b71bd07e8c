"""Checkpoints with fp8 weights (checkpoint/fp8_checkpoint.py), written here as the quantizers lay them out: torch's
own float8_e4m3fn weights with their scales beside them (per output row as llm-compressor's FP8 scheme, per
tensor as AutoFP8, per block as DeepSeek-style weight_scale_inv), static input scales and a quantization_config.
The reference for each is a float32 checkpoint of torch's own dequantization, q.float() * scale: cbjax's load
must give the same parameters bit for bit, and its engine transformers' greedy tokens on those floats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import ENGINE_OPTIONS, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.convert import read_hf_params
from cbjax.checkpoint.kv_scale_tensors import read_kv_scales
from cbjax.checkpoint.loader import load_model
from cbjax.models.config import ModelConfig

BLOCK = 32  # the per-block form's weight_block_size (the tiny model's widths are 64-128)
FORMS = {
    "per-row": {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
    "per-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "per-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
}


def fp8_scales(weight: torch.Tensor, form: str) -> torch.Tensor:
    """The scale of each element's group (broadcast to the weight): its largest |w| over e4m3's 448."""
    if form == "per-tensor":
        return weight.abs().max() / 448
    if form == "per-row":
        return weight.abs().amax(dim=1, keepdim=True) / 448
    rows, cols = weight.shape
    blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).abs().amax(dim=(1, 3)) / 448
    return blocks.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)


def write_fp8_checkpoint(hf_dir: Path, out: Path, form: str, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """`out`: hf_dir with its decoder projections as fp8 + scales (and input scales); `out`-float: torch's
    dequantization of the same, float32, no quantization_config."""
    weights = load_file(hf_dir / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, weight in weights.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            quantized[name] = dequantized[name] = weight
            continue
        scale = fp8_scales(weight, form)
        q = (weight / scale).to(torch.float8_e4m3fn)
        quantized[name] = q
        dequantized[name] = q.float() * scale
        stored = scale[::BLOCK, ::BLOCK].contiguous() if form == "per-block" else scale.reshape(-1)[:1] if (
            form == "per-tensor") else scale
        quantized[name + ("_scale_inv" if form == "per-block" else "_scale")] = stored.contiguous()
        quantized[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
    for folder, tensors, quant in ((out, quantized | (extra or {}), FORMS[form]),
                                   (out.with_name(out.name + "-float"), dequantized, None)):
        shutil.copytree(hf_dir, folder)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        if quant is not None:
            config["quantization_config"] = quant
        (folder / "config.json").write_text(json.dumps(config))
    return out


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


def test_an_fp8_checkpoint_serves_transformers_greedy_tokens_on_its_dequantized_weights(tiny, tmp_path):
    """LLM(model=<fp8 checkpoint>) as vLLM takes one, its KV-cache scales beside (llm-compressor's names)."""
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
