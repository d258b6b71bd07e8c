"""Checkpoints with fp8 weights as the quantizers write them, from a tiny float HF model (tests/checkpoint/
test_fp8_checkpoint.py says what is checked against them; tensor_parallel_checks.py splits one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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
