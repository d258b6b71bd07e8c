"""The PEFT adapter reader alone (no model, no JAX): scaling folded into B as peft computes it, and what it refuses."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from cbjax.lora.peft import read_peft_adapter
from cbjax.lora.request import LoRARequest

SHAPES = {(0, "self_attn.q_proj"): (8, 8), (0, "self_attn.v_proj"): (8, 4)}


def write(folder, config: dict, tensors: dict) -> LoRARequest:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return LoRARequest(folder.name, 1, str(folder))


def factors(rank: int, fan_in: int, fan_out: int, name: str = "self_attn.q_proj") -> dict:
    rng = np.random.default_rng(rank)
    prefix = f"base_model.model.model.layers.0.{name}"
    return {f"{prefix}.lora_A.weight": rng.normal(size=(rank, fan_in)).astype(np.float32),
            f"{prefix}.lora_B.weight": rng.normal(size=(fan_out, rank)).astype(np.float32)}


@pytest.mark.parametrize(("rslora", "scaling"), [(False, 6 / 4), (True, 6 / math.sqrt(4))])
def test_b_carries_alpha_over_rank_or_its_square_root(tmp_path, rslora, scaling):
    tensors = factors(4, 8, 4, "self_attn.v_proj")
    request = write(tmp_path / "v", {"r": 4, "lora_alpha": 6, "target_modules": ["v_proj"], "use_rslora": rslora}, tensors)
    adapter = read_peft_adapter(request, SHAPES, max_lora_rank=8)
    a, b = adapter.factors[(0, "self_attn.v_proj")]
    prefix = "base_model.model.model.layers.0.self_attn.v_proj"
    np.testing.assert_array_equal(a, tensors[f"{prefix}.lora_A.weight"])
    np.testing.assert_allclose(b, scaling * tensors[f"{prefix}.lora_B.weight"].T, rtol=1e-6)
    assert set(adapter.factors) == {(0, "self_attn.v_proj")} and adapter.rank == 4


@pytest.mark.parametrize(("config", "message"), [
    ({"use_dora": True}, "use_dora=True; only use_dora=False"),
    ({"bias": "all"}, "bias='all'; only bias='none'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=\\['lm_head'\\]"),
    ({"target_modules": "all-linear"}, "target_modules \\['all-linear'\\] are not LoRA targets"),
])
def test_refuses_what_changes_the_function_beyond_a_and_b(tmp_path, config, message):
    request = write(tmp_path / "odd", {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"], **config}, factors(2, 8, 8))
    with pytest.raises(ValueError, match=f"'odd'.*{message}"):
        read_peft_adapter(request, SHAPES, max_lora_rank=8)


def test_refuses_a_factor_without_its_pair_and_a_layer_the_model_lacks(tmp_path):
    lone = {k: v for k, v in factors(2, 8, 8).items() if "lora_A" in k}
    with pytest.raises(ValueError, match="lora_A without its other factor"):
        read_peft_adapter(write(tmp_path / "lone", {"r": 2, "target_modules": ["q_proj"]}, lone), SHAPES, 8)
    deep = {k.replace("layers.0.", "layers.5."): v for k, v in factors(2, 8, 8).items()}
    with pytest.raises(ValueError, match="self_attn.q_proj of layer 5, which the model does not have"):
        read_peft_adapter(write(tmp_path / "deep", {"r": 2, "target_modules": ["q_proj"]}, deep), SHAPES, 8)
