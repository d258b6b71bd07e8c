"""An fp8 KV cache's scales stored in a Hugging Face checkpoint, one k_scale and one v_scale per layer,
under the names the quantizers write and vLLM reads:

    model.layers.N.self_attn.k_scale, .v_scale                 llm-compressor (compressed-tensors' kv_cache_scheme)
    model.layers.N.self_attn.k_proj.k_scale, .v_proj.v_scale   NVIDIA ModelOpt
    model.layers.N.self_attn.kv_scale                          AutoFP8's older single scale, for K and V alike

A pool element e stands for e * scale, in vLLM's kernels as in cbjax's (kernels_pallas/reference.py), so the
numbers are used as they are. Only one scale per layer (a per-tensor scheme) is taken; per-head or per-channel
scales are refused by name and shape. A conversion keeps the scales in kv_scales.json beside config.json (the
orbax parameters hold the model's weights only); a Hugging Face directory is read directly. No JAX here: the
engine reads them before it compiles its steps (worker/kv_scales.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from cbjax.checkpoint.layout import KV_SCALES_FILE
from cbjax.checkpoint.safetensors_io import safetensors_files

_SCALE_NAME = re.compile(r"model\.layers\.(?P<layer>\d+)\.self_attn\.(?:k_proj\.(?=k_)|v_proj\.(?=v_))?"
                         r"(?P<kind>k_scale|v_scale|kv_scale)")


def kv_scale_slot(hf_name: str) -> tuple[int, str] | None:
    """(layer, "k_scale" / "v_scale" / "kv_scale") for a KV-cache scale tensor's name, else None."""
    match = _SCALE_NAME.fullmatch(hf_name)
    return None if match is None else (int(match["layer"]), match["kind"])


def _one_scale(hf_name: str, tensor: np.ndarray, source: str) -> float:
    if tensor.size != 1:
        raise ValueError(f"{source}: {hf_name} has shape {tuple(tensor.shape)}; cbjax takes one fp8 KV scale per "
                         "layer (a per-tensor kv_cache_scheme), not one per head or channel. Requantize the KV cache "
                         "with strategy 'tensor', or drop the scale tensors and pass calculate_kv_scales=True")
    value = float(np.asarray(tensor, np.float64).reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source}: {hf_name} is {value}; an fp8 KV scale must be finite and positive. Drop the "
                         "scale tensors, or pass calculate_kv_scales=True to compute them at start-up")
    return value


def collect_kv_scales(tensors: dict[str, np.ndarray], num_layers: int, source: str) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) from the scale tensors by HF name (kv_scale: both), None where there are none;
    a ValueError naming the layers that lack one, or a layer the model does not have."""
    found: dict[tuple[int, str], float] = {}
    for hf_name, tensor in tensors.items():
        layer, kind = kv_scale_slot(hf_name)
        if layer >= num_layers:
            raise ValueError(f"{source}: {hf_name} is for layer {layer}; the model has {num_layers} layers")
        value = _one_scale(hf_name, tensor, source)
        for kept in ("k_scale", "v_scale") if kind == "kv_scale" else (kind,):
            found[layer, kept] = value
    if not found:
        return None
    missing = [f"{layer}.{kind}" for layer in range(num_layers) for kind in ("k_scale", "v_scale")
               if (layer, kind) not in found]
    if missing:
        raise ValueError(f"{source} holds fp8 KV scales for some layers but not these: {', '.join(missing)}; every "
                         "layer needs its k_scale and v_scale (or one kv_scale)")
    return [(found[layer, "k_scale"], found[layer, "v_scale"]) for layer in range(num_layers)]


def read_kv_scales(checkpoint_dir: str | Path, num_layers: int) -> list[tuple[float, float]] | None:
    """The checkpoint's per-layer (k_scale, v_scale): from kv_scales.json (a converted checkpoint) or from the
    safetensors of a Hugging Face directory (only the scale tensors are read); None where it has none."""
    checkpoint_dir = Path(checkpoint_dir)
    stored = checkpoint_dir / KV_SCALES_FILE
    if stored.is_file():
        scales = json.loads(stored.read_text())
        return collect_kv_scales({f"model.layers.{layer}.self_attn.{kind}": np.float64(value)
                                  for kind in ("k_scale", "v_scale") for layer, value in enumerate(scales[kind])},
                                 num_layers, str(stored))
    if not any(checkpoint_dir.glob("*.safetensors")):
        return None
    tensors = {}
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="numpy") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys() if kv_scale_slot(name) is not None})
    return collect_kv_scales(tensors, num_layers, str(checkpoint_dir))


def write_kv_scales(out_dir: Path, scales: list[tuple[float, float]]) -> None:
    """kv_scales.json in a converted checkpoint: {"k_scale": [one per layer], "v_scale": [...]}."""
    k_scales, v_scales = zip(*scales)
    (out_dir / KV_SCALES_FILE).write_text(json.dumps({"k_scale": list(k_scales), "v_scale": list(v_scales)}) + "\n")
