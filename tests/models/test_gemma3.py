"""Gemma 3 (text): its config.json read as transformers reads it, in 4.x and 5.x form and with keys left out, and
its embedding scale rounded as transformers rounds it. Parity with transformers' logits is in
test_model_parity.py, greedy tokens through the engine in test_registry.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

from cbjax.models.config import ModelConfig, RopeScaling
from cbjax.models.registry import model_class
from cbjax.plan.capacity import PRESETS_DIR
from helpers_hf import ARCHITECTURES as HF_ARCHITECTURES

GEMMA3_1B_4X_CONFIG = dict(  # google/gemma-3-1b-it's config.json fields, in 4.x form (no layer_types)
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
    intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, query_pre_attn_scalar=256,
    rope_local_base_freq=10000, rope_theta=1000000, rope_scaling=None, sliding_window=512, sliding_window_pattern=6,
    attn_logit_softcapping=None, final_logit_softcapping=None, rms_norm_eps=1e-6, torch_dtype="bfloat16",
    bos_token_id=2, eos_token_id=[1, 106])


@pytest.mark.parametrize("form", ["4.x", "5.x"])
def test_gemma3_config_gives_every_sixth_layer_global_attention_and_rope(form):
    hf = dict(GEMMA3_1B_4X_CONFIG)
    if form == "5.x":  # what transformers 5 writes: layer types and RoPE parameters keyed by them
        hf["layer_types"] = HF_ARCHITECTURES["gemma3_text"][0](**hf).layer_types
        hf["rope_parameters"] = dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                     sliding_attention=dict(rope_type="default", rope_theta=1e4))
        for old in ("rope_local_base_freq", "rope_theta", "rope_scaling", "sliding_window_pattern"):
            hf.pop(old)
    config = ModelConfig.from_hf_config(hf)
    global_layers = [5, 11, 17, 23]  # (layer + 1) % 6 == 0
    assert [layer for layer, window in enumerate(config.sliding_windows) if window is None] == global_layers
    assert {config.sliding_window(layer) for layer in range(26) if layer not in global_layers} == {512}
    assert [config.rope(layer)[0] for layer in (0, 4, 5, 6, 23, 25)] == [1e4, 1e4, 1e6, 1e4, 1e6, 1e4]
    assert config.sm_scale == 256**-0.5 and config.hidden_act == "gelu_pytorch_tanh" and config.qk_norm


def test_gemma3_with_global_rope_scaling_scales_only_the_global_layers():
    config = ModelConfig.from_hf_config({**GEMMA3_1B_4X_CONFIG, "rope_scaling": dict(rope_type="linear", factor=8.0)})
    assert config.rope(5) == (1e6, RopeScaling("linear", factor=8.0)) and config.rope(0) == (1e4, RopeScaling())


def test_gemma_attention_logit_softcapping_is_refused_by_name():
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not supported"):
        ModelConfig.from_hf_config({**GEMMA3_1B_4X_CONFIG, "attn_logit_softcapping": 50.0})


def test_gemma3_config_keys_left_out_mean_transformers_defaults():
    minimal = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=7)
    config, hf = ModelConfig.from_hf_config(minimal), HF_ARCHITECTURES["gemma3_text"][0](num_hidden_layers=7)
    assert config.sliding_windows == tuple(hf.sliding_window if kind == "sliding_attention" else None
                                           for kind in hf.layer_types)
    assert [config.rope(layer)[0] for layer in range(7)] == [hf.rope_parameters[kind]["rope_theta"] for kind in hf.layer_types]
    assert (config.tie_word_embeddings, config.hidden_act, config.head_dim, config.sm_scale, config.eos_token_id) == (
        hf.tie_word_embeddings, hf.hidden_activation, hf.head_dim, hf.query_pre_attn_scalar**-0.5, (hf.eos_token_id,))
    assert (config.vocab_size, config.hidden_size, config.max_position_embeddings) == (
        hf.vocab_size, hf.hidden_size, hf.max_position_embeddings)


def test_gemma3_embeddings_scale_by_sqrt_hidden_rounded_to_the_weights_dtype():
    """sqrt(24) is 4.899, but transformers multiplies by it in the table's dtype: 4.906 in bfloat16."""
    hf = HF_ARCHITECTURES["gemma3_text"][0](vocab_size=8, hidden_size=24, intermediate_size=8, num_hidden_layers=1,
                                            num_attention_heads=1, num_key_value_heads=1, head_dim=8).to_dict()
    config = ModelConfig.from_hf_config({**hf, "architectures": ["Gemma3ForCausalLM"]})
    model = model_class(config)(config, dtype=jnp.bfloat16, activation_dtype=jnp.float32, rngs=nnx.Rngs(0))
    torch.manual_seed(0)
    reference = Gemma3TextScaledWordEmbedding(8, 24, 0, embed_scale=24**0.5).to(torch.bfloat16)
    model.model.embed_tokens.embedding[...] = jnp.asarray(reference.weight.detach().float().numpy(), jnp.bfloat16)
    token_ids = [0, 3, 7]
    expected = reference(torch.tensor(token_ids)).detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(model.embed(jnp.array(token_ids))), expected)


def test_gemma3_27b_layers_lower_for_cuda_at_tp8_from_the_config_alone(tmp_path):
    """Its first six layers (five windowed local, one global): the windowed Pallas kernels under shard_map,
    16 KV heads over 8 devices, from abstract weights. Its own process: the CLI asks for 8 virtual CPU devices."""
    config = json.loads((PRESETS_DIR / "gemma-3-27b.json").read_text()) | {"num_hidden_layers": 6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "cbjax", "lower", "--config", str(tmp_path / "config.json"), "--tensor-parallel-size", "8",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--max-model-len", "64", "--block-size", "16"],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lowered 2/2 steps for cuda with backend pallas at tensor_parallel_size=8" in done.stdout
    assert all("8 partitions" in line for line in done.stdout.splitlines() if "partitions" in line)
