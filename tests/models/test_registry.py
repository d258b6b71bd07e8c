"""The model registry: one entry per architecture answers what the engine asks of a model, and
OLMo-2 runs through it alone (parity with transformers is in test_model_parity.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.checkpoint.params import expected_params, hf_to_params, stack_experts
from cbjax.models.config import ModelConfig
from cbjax.models.registry import ARCHITECTURES, kv_cache_bytes_per_block, kv_cache_spec
from cbjax.plan.accelerators import ACCELERATORS
from cbjax.plan.capacity import load_model_config, plan_capacity
from engine_helpers import hf_greedy
from test_prefix_caching_engine import drain
from helpers_hf import ARCHITECTURES as HF_ARCHITECTURES, load_hf_model, make_tiny_hf_model
from tiny_checkpoint import TINY_VOCAB, make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_registry_model_config_and_checkpoint_resolution_import_no_jax():
    # The package's own __init__ (the public API) is skipped: this checks the modules the front end reads.
    code = (
        "import sys, types; package = types.ModuleType('cbjax'); package.__path__ = ['cbjax']; sys.modules['cbjax'] = package; "
        "import cbjax.models.registry, cbjax.models.config, cbjax.models.tensor_parallel, cbjax.checkpoint.resolve; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'jaxlib')))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("arch", sorted(HF_ARCHITECTURES))
def test_hf_weight_names_map_onto_the_registered_models_parameters(tmp_path, arch):
    hf_dir = make_tiny_hf_model(tmp_path, arch)
    config = ModelConfig.from_dir(hf_dir)
    assert ARCHITECTURES[config.architecture].model_type == arch
    # The model in memory: transformers 5 holds MoE experts fused ([E, 2 x inner, hidden]), not as save_pretrained writes them.
    pieces = (piece for hf_name, tensor in load_hf_model(hf_dir).state_dict().items()
              for piece in hf_to_params(hf_name, tensor.numpy(), config))
    mapped = {name: array.shape for name, array in stack_experts(pieces, config.num_experts, str(hf_dir))}
    assert mapped == {name: spec.shape for name, spec in expected_params(config, np.float32).items()}


def test_a_config_without_architectures_is_read_by_its_model_type():
    hf = json.loads(json.dumps(HF_ARCHITECTURES["olmo2"][0](vocab_size=64, hidden_size=32, num_attention_heads=2).to_dict()))
    hf.pop("architectures", None)
    assert ModelConfig.from_hf_config(hf).architecture == "Olmo2ForCausalLM"


def test_unknown_architecture_names_every_registered_one():
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM is not supported; supported: LlamaForCausalLM, .*Olmo2ForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["GPTNeoXForCausalLM"]})


def test_kv_layout_is_worked_by_hand(tmp_path):
    config = ModelConfig.from_dir(make_tiny_hf_model(tmp_path, "qwen3", num_key_value_heads=1))
    # 2 layers x (K, V) x 1 KV head x 4 tokens x head_dim 32 x 2 bytes (float16).
    assert kv_cache_bytes_per_block(config, 4, np.float16) == 2 * 2 * 1 * 4 * 32 * 2 == 1024
    # Layer l's copy of block b is page l * num_blocks + b: 2 layers x 10 blocks.
    assert kv_cache_spec(config).pool_shape(10, 4) == (1, 20, 4, 32)


def olmo2_7b_config(tmp_path: Path) -> Path:
    """OLMo-2-1124-7B's shapes: hidden 4096, 32 heads of 128 (no GQA), intermediate 11008, 32 layers, vocab 100352."""
    config = HF_ARCHITECTURES["olmo2"][0](
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    path = tmp_path / "olmo2-7b.json"
    path.write_text(config.to_json_string())
    return path


@pytest.mark.parametrize("tp", [1, 4])
def test_plan_counts_olmo2_weights_with_its_whole_projection_norms(tmp_path, tp):
    name, config = load_model_config(str(olmo2_7b_config(tmp_path)))
    p = plan_capacity(name, config, ACCELERATORS["h100"], tp)
    # Per layer: q/k/v/o 4096 x 4096 and gate/up/down 4096 x 11008 split over tp; q_norm, k_norm (4096 each,
    # over the whole projection) and the post-attention and post-MLP norms replicated; embedding and head
    # 100352 x 4096 split by vocabulary; the final norm. At tp=1: 7.30 B parameters, OLMo-2 7B's count.
    per_layer = (4 * 4096 * 4096 + 3 * 4096 * 11008) // tp + 4 * 4096
    params = 32 * per_layer + 2 * 100352 * 4096 // tp + 4096
    assert p.weight_bytes_per_device == 2 * params
    assert tp > 1 or params == 7_298_617_344
    assert p.kv_bytes_per_token_per_device == 2 * (32 // tp) * 128 * 2 * 32


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_a_window_shorter_than_the_prompt_serves_greedy_like_transformers(tmp_path, arch):
    """Window 11 (across block boundaries) against prompts of 37, 21, 9 and 30 tokens, in chunks of 16
    beside decodes, in a pool small enough to preempt, with prefix caching on (the fourth prompt starts
    with the first's 24 tokens) and NaN in every free block after each step. Full attention gives other tokens.
    Mistral windows every layer; Gemma 3 its local layers, between global ones, each kind with its own RoPE base."""
    hf_dir, ckpt = make_tiny_checkpoint(tmp_path, arch, sliding_window=11)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (37, 21, 9)]
    prompts.append(prompts[0][:24] + rng.integers(3, 300, size=6).tolist())
    llm = LLM(str(ckpt), max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16, block_size=8, num_kv_blocks=14,
              dtype="float32", enable_prefix_caching=True)
    engine = llm.llm_engine
    assert engine.backend in ("cpp", "pallas")  # "auto" picks the kernels: each has the window
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, greedy) for i, p in enumerate(prompts[:3])], 3: [("r3", prompts[3], greedy)]}
    finished = drain(engine, arrivals, {})
    want = [hf_greedy(hf_dir, p, 6) for p in prompts]
    assert [finished[f"r{i}"].outputs[0].token_ids for i in range(4)] == want
    assert finished["r3"].num_cached_tokens > 0
    assert engine.get_stats()["num_preemptions"] > 0
    full = make_tiny_hf_model(tmp_path, arch, name="full", vocab_size=TINY_VOCAB, max_position_embeddings=512,
                              sliding_window=512)
    assert [hf_greedy(full, p, 6) for p in prompts] != want  # the same weights, a window longer than every prompt


def test_olmo2_serves_through_the_engine_greedy_like_transformers(tmp_path):
    hf_dir, ckpt = make_tiny_checkpoint(tmp_path, "olmo2")
    llm = LLM(str(ckpt), max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, block_size=8, dtype="float32")
    prompts = [[3 + (5 * i + 11 * n) % 290 for i in range(n)] for n in (21, 9, 1)]  # 21: prefilled in two chunks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_dir, p, 8) for p in prompts]

