"""Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into per-projection factors.

PEFT stores, for each targeted projection, `lora_A.weight` [r, in] and `lora_B.weight` [out, r] under
the base model's module names (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`); the
projection computes x @ W + scaling * (x @ A.T) @ B.T, with scaling = lora_alpha / r, or
lora_alpha / sqrt(r) under rsLoRA (peft's LoraLayer.update_layer). Here B is kept as [r, out] with the
scaling folded in, so the engine adds (x @ A.T) @ B. numpy only: no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from jaxtyping import Float
from safetensors import safe_open

from cbjax.lora.request import LoRARequest

# Projections an adapter may target, by the module name PEFT gives them (the last part of its path).
TARGET_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                  "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                  "down_proj": "mlp.down_proj"}
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<part>\w+\.\w+)\.lora_(?P<factor>[AB])"
                     r"(?:\.default)?\.weight")
# adapter_config.json keys whose non-default values would change the function beyond A, B and scaling.
_UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
                "fan_in_fan_out": False}

Part = tuple[int, str]  # (layer, "self_attn.q_proj")


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's factors, by (layer, projection): A [r, in] and scaling * B [r, out]."""

    request: LoRARequest
    rank: int
    factors: dict[Part, tuple[Float[np.ndarray, "rank in"], Float[np.ndarray, "rank out"]]]


def read_peft_adapter(request: LoRARequest, shapes: Mapping[Part, tuple[int, int]], max_lora_rank: int) -> LoRAAdapter:
    """The adapter `request` names, checked against the projections the model has (`shapes`:
    (layer, projection) -> (in, out)) and max_lora_rank; ValueError naming the adapter and the value otherwise."""
    where = f"LoRA adapter {request.lora_name!r} (lora_int_id={request.lora_int_id}, path {request.lora_path})"
    folder = Path(request.lora_path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for path in (config_file, weights_file):
        if not path.is_file():
            raise ValueError(f"{where}: {path} does not exist; give the folder PEFT's save_pretrained wrote "
                             "(adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    for key, default in _UNSUPPORTED.items():
        if config.get(key) not in (None, default, [], {}):
            raise ValueError(f"{where}: adapter_config.json has {key}={config[key]!r}; only {key}={default!r} is supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank > max_lora_rank:
        raise ValueError(f"{where}: rank r={rank} exceeds max_lora_rank={max_lora_rank}; raise max_lora_rank to {rank}")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"{where}: target_modules {unknown} are not LoRA targets here; supported: {sorted(TARGET_MODULES)}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    found: dict[Part, dict[str, np.ndarray]] = {}
    with safe_open(str(weights_file), framework="numpy") as tensors:
        for name in tensors.keys():
            match = _TENSOR.fullmatch(name)
            if match is None:
                raise ValueError(f"{where}: tensor {name} is not a LoRA factor of a decoder projection "
                                 f"({', '.join(sorted(TARGET_MODULES))})")
            part = (int(match["layer"]), match["part"])
            found.setdefault(part, {})[match["factor"]] = tensors.get_tensor(name).astype(np.float32)
    factors = {}
    for part, pair in sorted(found.items()):
        if part not in shapes:
            raise ValueError(f"{where}: it adapts {part[1]} of layer {part[0]}, which the model does not have "
                             "(or has as experts); the model's projections are the dense q/k/v/o and gate/up/down")
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {part[1]} of layer {part[0]} has lora_{''.join(pair)} without its other factor")
        (fan_in, fan_out), a, b = shapes[part], pair["A"], pair["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(f"{where}: {part[1]} of layer {part[0]} has lora_A {a.shape} and lora_B {b.shape}; "
                             f"the base model needs ({rank}, {fan_in}) and ({fan_out}, {rank}) (r={rank}): "
                             "was it trained on another base model?")
        factors[part] = (a, (b * scaling).T.copy())
    return LoRAAdapter(request, rank, factors)
