"""Tiny random Hugging Face models saved as HF directories: the reference that cbjax is checked against.

    hf_dir = make_tiny_hf_model(tmp_path, "qwen3", num_key_value_heads=1)
    logits = hf_logits(hf_dir, [3, 1, 4, 1, 5])  # float32 [5, vocab]

Weights are redrawn after HF's init (norm scales around 1, biases nonzero, std `weight_std`), so
every parameter, including the ones HF initializes to 0 or 1, changes the output and a mapping
mistake cannot hide.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
import transformers

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}

TINY_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
# Per-architecture defaults that make the tiny model exercise what is special about it.
ARCH_DEFAULTS = {
    "llama": {},
    "mistral": dict(sliding_window=None),  # full attention unless a test sets a window (test_registry.py)
    "qwen2": {},
    "qwen3": dict(head_dim=32),  # head_dim != hidden_size / num_attention_heads (16)
    "olmo2": dict(pad_token_id=0),  # its default pad id 1 is the tiny models' bos
    # 8 experts, top 2 (routing matters); layer 1 dense (mlp_only_layers), 96 wide beside the experts' 32.
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                      mlp_only_layers=[1], norm_topk_prob=False),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=None),
    # 4 layers, local and global alternating (4.x's sliding_window_pattern) with their own RoPE bases, the
    # global one linearly scaled; a window of 5 (shorter than the tests' prompts); scores scaled by 20 ** -0.5,
    # not head_dim's; logits capped at 4 (uncapped they reach about 6, so the tanh bends the largest).
    "gemma3_text": dict(num_hidden_layers=4, head_dim=32, sliding_window=5, sliding_window_pattern=2, rope_theta=1000.0,
                        rope_local_base_freq=50.0, rope_scaling=dict(rope_type="linear", factor=2.0),
                        query_pre_attn_scalar=20, final_logit_softcapping=4.0, tie_word_embeddings=True,
                        pad_token_id=0),
}


def make_tiny_hf_model(
    tmp_path: Path,
    arch: str = "llama",
    *,
    name: str | None = None,
    seed: int = 0,
    weight_std: float = 0.1,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Save a random tiny `arch` model (config.json + safetensors) under tmp_path and return its directory.

    `overrides` go to the transformers config (e.g. tie_word_embeddings=True, rope_parameters={...});
    `max_shard_size` (e.g. "20KB") writes sharded safetensors with an index.
    """
    config_cls, model_cls = ARCHITECTURES[arch]
    config = config_cls(**{**TINY_DEFAULTS, **ARCH_DEFAULTS[arch], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, weight_std)
    hf_dir = Path(tmp_path) / (name or f"tiny-{arch}")
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(hf_dir, **kwargs)
    return hf_dir


@functools.lru_cache(maxsize=16)
def load_hf_model(hf_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_logits(hf_dir: Path, token_ids: list[int]) -> np.ndarray:
    """Transformers' float32 logits [len(token_ids), vocab] for one sequence, at every position."""
    with torch.no_grad():
        out = load_hf_model(Path(hf_dir))(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()
