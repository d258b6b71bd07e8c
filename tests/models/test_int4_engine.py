"""LLM(quantization="int4") end to end against transformers running the same 4-bit weights dequantized.

As in test_int8_engine.py the reference is independent of the wiring: each projection's HF weight
[out, in] is quantized in groups of 128 inputs (kernels_cpu/quant4.py) and written back as q * scales +
mins, so transformers computes the function an engine with the right nibbles, groups, fusing and panels
computes, to float32 accumulation. The tiny model is 128 wide (the group must divide every input dim).
"""

from __future__ import annotations

import copy
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from engine_helpers import ENGINE_OPTIONS, hf_greedy, random_prompts
from helpers_hf import load_hf_model
from test_packed_matmul import forward_logits
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.loader import load_model
from kernels_cpu.quant4 import dequantize_int4, quantize_int4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(converted checkpoint, hf_dir of the same model with its projections int4-dequantized)."""
    root = tmp_path_factory.mktemp("int4")
    hf_dir, checkpoint = make_tiny_checkpoint(root, "llama", hidden_size=128, intermediate_size=256)
    model = copy.deepcopy(load_hf_model(hf_dir))  # a copy: load_hf_model's is cached and shared
    with torch.no_grad():
        for name, module in model.named_modules():
            if ".layers." in name and name.endswith("_proj"):
                w = dequantize_int4(*quantize_int4(module.weight.numpy().T))  # groups run along the input dim
                module.weight.copy_(torch.from_numpy(w.T.astype(np.float32)))
    model.save_pretrained(root / "dequantized")
    return checkpoint, root / "dequantized"


def test_int4_greedy_tokens_equal_transformers_on_the_dequantized_weights(tiny):
    llm = LLM(str(tiny[0]), quantization="int4", **ENGINE_OPTIONS)
    runner = llm.llm_engine.runner
    on_cpu = jax.devices()[0].platform == "cpu"
    kernels = [leaf for leaf in runner.weights if getattr(leaf, "dtype", None) == np.uint8]
    # per layer: qkv (K 128), o (128), gate_up (128), down (256) as nibbles, [out / 32, in / 2, 32] panels on CPU
    assert len(kernels) == 8 and all(k.ndim == (3 if on_cpu else 2) for k in kernels)
    prompts = random_prompts(6, [5, 37, 60])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(tiny[1], p, 8) for p in prompts]


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the C++ kernel is an XLA:CPU custom call")
def test_int4_panels_by_the_cpp_kernel_give_the_unpacked_jnp_logits(tiny):
    """The C++ kernel's 4-bit panels compute what the jnp path (GPUs, TP, cpu_packed_weights=False) does."""
    unpacked, _ = load_model(tiny[0], quantization="int4")
    packed, _ = load_model(tiny[0], quantization="int4", pack_for_cpu=True)
    assert packed.model.layers[0].mlp.down_proj.kernel[...].shape == (128 // 32, 256 // 2, 32)
    assert unpacked.model.layers[0].mlp.down_proj.mins[...].shape == (256 // 128, 128)
    tokens = random_prompts(7, [30])[0]
    got, want = forward_logits(packed, tokens, "cpp"), forward_logits(unpacked, tokens, "cpp")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
