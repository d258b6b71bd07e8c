"""LLM(quantization="int8") end to end against transformers running the same int8 weights dequantized.

The reference is independent of the wiring under test: each projection's HF weight [out, in] is
quantized per output channel in torch's layout and written back as q * scales, so transformers
computes exactly the function an engine with the right weights, scales, fusing and layout computes,
to float32 accumulation. One tiny int8 engine (hidden 64, vocab 320) serves every test here; on a CPU it
multiplies int8 panels with the C++ kernel (kernels_cpu/packed_matmul.cc), elsewhere (x @ q) * scales in jnp.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from engine_helpers import COMPILES, ENGINE_OPTIONS, hf_greedy, random_prompts
from helpers_hf import hf_logits, load_hf_model
from test_packed_matmul import forward_logits
from tiny_checkpoint import make_tiny_checkpoint

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.loader import load_model
from cbjax.plan.capacity import PRESETS_DIR
from kernels_cpu.quant import quantize_int8

NUM_TOP = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(hf_dir, converted checkpoint, hf_dir of the same model with its projections int8-dequantized)."""
    root = tmp_path_factory.mktemp("int8")
    hf_dir, checkpoint = make_tiny_checkpoint(root, "llama")
    model = copy.deepcopy(load_hf_model(hf_dir))  # a copy: load_hf_model's is cached and shared
    with torch.no_grad():
        for name, module in model.named_modules():
            if ".layers." in name and name.endswith("_proj"):
                q, scales = quantize_int8(module.weight.numpy().T)  # per output channel: a column of [in, out]
                module.weight.copy_(torch.from_numpy((q.astype(np.float32) * scales).T))
    model.save_pretrained(root / "dequantized")
    return hf_dir, checkpoint, root / "dequantized"


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(str(tiny[1]), quantization="int8", **ENGINE_OPTIONS)


def test_projections_are_int8_with_float32_scales_and_the_rest_float(llm):
    runner = llm.llm_engine.runner
    model = nnx.merge(runner.graphdef, jax.tree_util.tree_unflatten(runner._state_treedef, runner.weights))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden, inner = 64, 128
    assert attn.qkv_proj.kernel.dtype == np.int8 and attn.qkv_proj.scales.shape == (hidden + 2 * 32,)
    on_cpu = jax.devices()[0].platform == "cpu"  # int8 panels [out / 32, in, 32] for the C++ matmul
    assert llm.llm_engine.backend == "cpp" or not on_cpu
    assert mlp.gate_up_proj.kernel.shape == ((2 * inner // 32, hidden, 32) if on_cpu else (hidden, 2 * inner))
    assert mlp.down_proj.scales.dtype == np.float32
    assert model.model.embed_tokens.embedding.dtype == np.float32 and model.lm_head.kernel.dtype == np.float32


def test_prompt_logprobs_equal_transformers_on_the_dequantized_weights(llm, tiny):
    prompts = random_prompts(3, [9, 40])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=1, prompt_logprobs=NUM_TOP), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ref = torch.log_softmax(torch.from_numpy(hf_logits(tiny[2], prompt)).double(), -1).numpy()
        for position in range(1, len(prompt)):
            got = {token: entry.logprob for token, entry in output.prompt_logprobs[position].items()}
            want = {token: ref[position - 1, token] for token in got}
            np.testing.assert_allclose(list(got.values()), list(want.values()), atol=2e-4)


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights_without_compiling(llm, tiny):
    prompts = random_prompts(4, [5, 37, 60])
    COMPILES.armed, COMPILES.count = True, 0
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    finally:
        COMPILES.armed = False
    assert COMPILES.count == 0
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(tiny[2], p, 8) for p in prompts]


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the C++ kernel is an XLA:CPU custom call")
def test_int8_panels_by_the_cpp_kernel_give_the_unpacked_jnp_logits(tiny):
    """The CPU engine's int8 panels through the C++ kernel compute what the unpacked (x @ q) * scales
    path does (served under TP or cpu_packed_weights=False); the panels' jnp fallback is checked in
    tests/kernels/test_packed_int8_matmul.py."""
    unpacked, _ = load_model(tiny[1], quantization="int8")
    packed, _ = load_model(tiny[1], quantization="int8", pack_for_cpu=True)
    assert packed.model.layers[0].self_attn.k_proj.kernel[...].shape == (1, 64, 32)  # 32 wide: one panel
    assert unpacked.model.layers[0].self_attn.k_proj.kernel[...].shape == (64, 32)
    tokens = random_prompts(5, [30])[0]  # forward_logits holds 32 tokens
    got, want = forward_logits(packed, tokens, "cpp"), forward_logits(unpacked, tokens, "cpp")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()  # the greedy token at every position


def test_int8_and_int4_steps_lower_for_cuda_at_tp8_from_abstract_weights(tmp_path):
    # Llama-3-70B's shapes with 2 of its 80 layers; one process for both (8 virtual CPU devices before JAX starts).
    config = (PRESETS_DIR / "llama-3-70b.json").read_text().replace('"num_hidden_layers": 80', '"num_hidden_layers": 2')
    assert '"num_hidden_layers": 2' in config
    (tmp_path / "config.json").write_text(config)
    args = ["lower", "--config", str(tmp_path), "--tensor-parallel-size", "8", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "16", "--max-model-len", "64", "--quantization"]
    done = subprocess.run(
        [sys.executable, "-c", f"from cbjax.entrypoints.cli.main import main; main({args + ['int8']!r}); print('int4'); "
                               f"main({args + ['int4']!r})"],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    int8, int4 = done.stdout.split("\nint4\n")
    assert all("lowered 2/2 steps for cuda with backend pallas at tensor_parallel_size=8" in out for out in (int8, int4))
    steps = {name: [line for line in out.splitlines() if "partitions" in line] for name, out in (("int8", int8), ("int4", int4))}
    # Per layer: 5 column-parallel int8 kernels (q/k/v/gate/up) and the LM head split by columns, their
    # 5 scales [out] split like their columns; o/down kernels (and the embedding) split by rows.
    assert len(steps["int8"]) == 2 and all(
        "8 partitions" in line and '11 x [{}, {"model"}]' in line and '10 x [{"model"}]' in line
        and '5 x [{"model"}, {}]' in line for line in steps["int8"]
    ), steps
    # int4 (groups of 128): the same kernels as nibbles, plus 5 x 2 scales and mins [groups, out] a layer split
    # by columns beside them, and o/down's 2 x 2 by groups (8192 / 8 and 28672 / 8 rows: 8 and 28 whole groups).
    assert len(steps["int4"]) == 2 and all(
        "8 partitions" in line and '31 x [{}, {"model"}]' in line and '13 x [{"model"}, {}]' in line
        for line in steps["int4"]
    ), steps
