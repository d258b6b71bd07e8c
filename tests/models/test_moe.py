"""Mixture-of-experts families (Qwen3-MoE, Mixtral) equal transformers, and the two expert matmuls equal
a per-token loop over the chosen experts.

Tiny random configs with 8 experts, top 2: Qwen3-MoE with q/k norms, top-k weights not renormalized
and layer 1 dense (mlp_only_layers); Mixtral with renormalized top-k weights in every layer. Each
case asserts, from transformers' own router logits, that its prompts route to every expert.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

from cbjax import LLM, SamplingParams
from cbjax.checkpoint import convert_checkpoint, load_model
from cbjax.checkpoint.convert import read_hf_params
from cbjax.models.config import ModelConfig
from cbjax.models.layers.attention import AttentionPlan
from cbjax.models.layers.moe import (
    DEFAULT_MOE_MATMUL,
    MOE_MATMUL_BY_PLATFORM,
    MOE_MATMULS,
    SparseMoeBlock,
    experts_per_platform,
    local_experts,
    route,
)
from cbjax.models.layers.mesh import MODEL_AXIS
from cbjax.plan.capacity import PRESETS_DIR
from engine_helpers import hf_greedy
from helpers_hf import hf_logits, load_hf_model, make_tiny_hf_model
from test_model_parity import ATOL, RTOL, Loaded, Seq, nan_pools, prefill, random_tokens
# Run here on this module's `loaded` (each MoE family with each expert matmul): decode steps reading KV back from the pool.
from test_model_parity import test_decode_steps_after_prefill_read_kv_back_from_pool  # noqa: F401
from test_prefix_caching_engine import drain
from tiny_checkpoint import make_tiny_checkpoint

FAMILIES = ("qwen3_moe", "mixtral")
NUM_EXPERTS, TOP_K = 8, 2
MODEL_SEED = 1  # whose random routers spread these prompts over all 8 experts (asserted below)


def experts_hf_routes_to(hf_dir, prompts: list[list[int]]) -> list[set[int]]:
    """Per sparse layer, the experts transformers' router picks for any token of the prompts."""
    used = None
    with torch.no_grad():
        for prompt in prompts:
            router_logits = load_hf_model(hf_dir)(torch.tensor([prompt]), output_router_logits=True).router_logits
            chosen = [set(torch.topk(logits, TOP_K, dim=-1).indices.flatten().tolist()) for logits in router_logits]
            used = chosen if used is None else [a | b for a, b in zip(used, chosen)]
    return used


def loop_reference(x, weights, experts, gate, up, down):
    """Token by token, chosen expert by chosen expert: silu(x W_gate) * (x W_up) W_down, weighted."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            out[t] += w * ((jax.nn.silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    return out


@pytest.mark.parametrize("matmul", sorted(MOE_MATMULS))
@pytest.mark.parametrize("num_tokens", [1, 13, 32])
def test_expert_matmul_equals_a_loop_over_each_tokens_chosen_experts(matmul, num_tokens):
    keys = jax.random.split(jax.random.key(num_tokens), 5)
    hidden, inner = 16, 24
    x = jax.random.normal(keys[0], (num_tokens, hidden))
    gate, up = (jax.random.normal(k, (NUM_EXPERTS, hidden, inner)) / 4 for k in keys[1:3])
    down = jax.random.normal(keys[3], (NUM_EXPERTS, inner, hidden)) / 4
    weights, experts = route(jax.random.normal(keys[4], (num_tokens, NUM_EXPERTS)), TOP_K, renormalize=False)
    got = jax.jit(MOE_MATMULS[matmul], static_argnums=6)(x, weights, experts, gate, up, down, jnp.float32)
    want = loop_reference(*(np.asarray(a) for a in (x, weights, experts, gate, up, down)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("matmul", sorted(MOE_MATMULS))
def test_expert_parallel_devices_local_experts_sum_to_the_loop_over_chosen_experts(matmul):
    """Expert parallelism's per-device computation: 4 devices (a vmap named like the mesh axis, summed as the
    psum does) of 2 whole experts each, every device given every token, other devices' experts contributing nothing."""
    num_tokens, hidden, inner, num_devices = 13, 16, 24, 4
    keys = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(keys[0], (num_tokens, hidden))
    gate, up = (jax.random.normal(k, (NUM_EXPERTS, hidden, inner)) / 4 for k in keys[1:3])
    down = jax.random.normal(keys[3], (NUM_EXPERTS, inner, hidden)) / 4
    weights, experts = route(jax.random.normal(keys[4], (num_tokens, NUM_EXPERTS)), TOP_K, renormalize=False)
    num_local = NUM_EXPERTS // num_devices
    per_device = jax.vmap(
        lambda *kernels: MOE_MATMULS[matmul](x, *local_experts(weights, experts, num_local), *kernels, jnp.float32),
        axis_name=MODEL_AXIS,
    )
    by_device = (k.reshape(num_devices, num_local, *k.shape[1:]) for k in (gate, up, down))
    got = jax.jit(per_device)(*by_device).sum(axis=0)
    want = loop_reference(*(np.asarray(a) for a in (x, weights, experts, gate, up, down)))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_router_takes_softmax_top_k_and_renormalizes_only_when_asked():
    logits = jnp.log(jnp.array([[0.1, 0.4, 0.2, 0.3]]))  # softmax gives these probabilities back
    weights, experts = route(logits, 2, renormalize=False)
    np.testing.assert_allclose(np.asarray(weights), [[0.4, 0.3]], rtol=1e-6)
    assert experts.tolist() == [[1, 3]]
    weights, _ = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(np.asarray(weights), [[0.4 / 0.7, 0.3 / 0.7]], rtol=1e-6)


@pytest.fixture(scope="module", ids="-".join, params=[(family, matmul) for family in FAMILIES for matmul in sorted(MOE_MATMULS)])
def loaded(request, tmp_path_factory) -> Loaded:
    family, matmul = request.param
    tmp = tmp_path_factory.mktemp(family)
    hf_dir = make_tiny_hf_model(tmp, family, seed=MODEL_SEED)
    model, config = load_model(convert_checkpoint(hf_dir, tmp / "converted"))
    sparse = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(sparse) == len(config.sparse_layers) == {"qwen3_moe": 1, "mixtral": 2}[family]
    for block in sparse:
        block.moe_matmul = matmul
    graphdef, state = nnx.split(model)

    def step(decode_only, kv_pool, token_ids, positions, metadata, logits_indices):
        return nnx.merge(graphdef, state)(token_ids, positions, kv_pool, metadata, logits_indices,
                                          AttentionPlan("xla", decode_only=decode_only))

    return Loaded(hf_dir, config, jax.jit(lambda *args: step(False, *args)), jax.jit(lambda *args: step(True, *args)))


def test_ragged_batch_logits_match_hf_with_every_expert_used(loaded):
    rng = np.random.default_rng(1)
    vocab = loaded.config.vocab_size
    seqs = [Seq(random_tokens(rng, vocab, 1), blocks=[5]), Seq(random_tokens(rng, vocab, 19), blocks=[14, 2, 20, 9, 17]),
            Seq(random_tokens(rng, vocab, 7), blocks=[11, 8])]
    assert experts_hf_routes_to(loaded.hf_dir, [seq.token_ids for seq in seqs]) == [set(range(NUM_EXPERTS))] * len(
        loaded.config.sparse_layers)
    all_logits, _ = prefill(loaded, seqs, nan_pools(loaded.config))
    for seq, logits in zip(seqs, all_logits):
        np.testing.assert_allclose(logits, hf_logits(loaded.hf_dir, seq.token_ids), atol=ATOL, rtol=RTOL)


# Chunks of at most 16 tokens, a pool of 13 usable blocks of 8 for prompts of 37 + 21 + 9 + 30 tokens and their
# continuations (preempts), prefix caching on (the fourth prompt starts with the first's 24 tokens).
ENGINE_OPTIONS = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16, block_size=8, num_kv_blocks=14,
                      dtype="float32", enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_transformers_batched_chunked_preempted_and_prefix_cached(tmp_path, family):
    hf_dir, ckpt = make_tiny_checkpoint(tmp_path, family, seed=MODEL_SEED)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (37, 21, 9)]
    prompts.append(prompts[0][:24] + rng.integers(3, 300, size=6).tolist())
    assert all(len(used) == NUM_EXPERTS for used in experts_hf_routes_to(hf_dir, prompts))
    llm = LLM(str(ckpt), **ENGINE_OPTIONS)
    engine = llm.llm_engine
    # The fourth arrives once the first is prefilled (its blocks cached); NaN in every free block after each step.
    arrivals = {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:3])], 3: [("r3", prompts[3], GREEDY)]}
    finished = drain(engine, arrivals, {})
    assert [finished[f"r{i}"].outputs[0].token_ids for i in range(4)] == [hf_greedy(hf_dir, p, 6) for p in prompts]
    assert finished["r3"].num_cached_tokens > 0
    assert engine.get_stats()["num_preemptions"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_fused_as_transformers_5_holds_them_convert_like_the_saved_per_expert_tensors(tmp_path, family):
    saved = make_tiny_hf_model(tmp_path, family)  # save_pretrained: experts.E.gate_proj / block_sparse_moe.experts.E.w1
    fused = tmp_path / "fused"  # the model's own state dict: mlp.experts.gate_up_proj [E, 2 x inner, hidden]
    fused.mkdir()
    shutil.copy(saved / "config.json", fused / "config.json")
    state = load_hf_model(saved).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, fused / "model.safetensors")
    config = ModelConfig.from_dir(saved)
    want, got = read_hf_params(saved, config, "float32", progress=False), read_hf_params(fused, config, "float32", progress=False)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_each_platform_lowers_its_own_default_expert_matmul():
    # XLA:CPU runs dense-masked faster at the engine's step shapes (benchmarks/moe_matmul.py); a GPU takes grouped.
    x, gate, down = jnp.ones((8, 16)), jnp.ones((NUM_EXPERTS, 16, 8)), jnp.ones((NUM_EXPERTS, 8, 16))
    weights, experts = route(jnp.ones((8, NUM_EXPERTS)), TOP_K, renormalize=True)
    step = jax.jit(lambda *args: experts_per_platform(*args, out_dtype=jnp.float32))
    lowered = {platform: step.trace(x, weights, experts, gate, gate, down).lower(lowering_platforms=(platform,)).as_text()
               for platform in ("cpu", "cuda")}
    assert MOE_MATMUL_BY_PLATFORM == {"cpu": "dense_masked"} and DEFAULT_MOE_MATMUL == "grouped"
    assert "ragged_dot" not in lowered["cpu"] and "ragged_dot" in lowered["cuda"]


@pytest.mark.parametrize(("family", "overrides"), [
    ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[])),
    ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[0, 2])),
    ("qwen3_moe", dict(num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[1])),  # no sparse layer left
])
def test_sparse_layers_are_those_transformers_builds_experts_in(tmp_path, family, overrides):
    hf_dir = make_tiny_hf_model(tmp_path, family, **overrides)
    want = tuple(i for i, layer in enumerate(load_hf_model(hf_dir).model.layers) if hasattr(layer.mlp, "experts"))
    assert ModelConfig.from_dir(hf_dir).sparse_layers == want
    assert read_hf_params(hf_dir, ModelConfig.from_dir(hf_dir), "float32", progress=False)  # and every tensor maps


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp8", "ep8"])
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_preset_lowers_for_cuda_at_tp8_and_ep8_from_its_config_alone(tmp_path, preset, expert_parallel):
    # The preset's shapes with 2 of its layers (every layer is sparse; each lowers alike). Its own process:
    # the CLI asks for 8 virtual CPU devices before JAX starts.
    num_layers = 2
    hf = json.loads((PRESETS_DIR / f"{preset}.json").read_text()) | {"num_hidden_layers": num_layers}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    done = subprocess.run(
        [sys.executable, "-m", "cbjax", "lower", "--config", str(tmp_path), "--tensor-parallel-size", "8",
         *(["--enable-expert-parallel"] if expert_parallel else []), "--max-num-seqs", "8",
         "--max-num-batched-tokens", "16", "--max-model-len", "64", "--block-size", "16"],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    mode = " with expert parallelism" if expert_parallel else ""
    assert f"lowered 2/2 steps for cuda with backend pallas at tensor_parallel_size=8{mode}" in done.stdout
    steps = [line for line in done.stdout.splitlines() if "partitions" in line]
    assert len(steps) == 2 and all("8 partitions" in line for line in steps)
    for line in steps:
        # 3-D arguments are the experts' [E, in, out] kernels: with EP all three split by expert (whole experts
        # per device); with TP gate/up split by columns, down by rows, within every expert.
        stacked = {spec: int(count) for count, spec in re.findall(r"(\d+) x (\[[^\]]*\])", line) if spec.count("{") == 3}
        want = ({'[{"model"}, {}, {}]': 3 * num_layers} if expert_parallel
                else {'[{}, {}, {"model"}]': 2 * num_layers, '[{}, {"model"}, {}]': num_layers})
        assert stacked == want, line
