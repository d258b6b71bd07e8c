"""Configuration dataclasses: the model's shape, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

from cbjax.models.registry import architecture_of_hf_config

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long context (HF `rope_type`)."""

    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 0  # llama3 only


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder; hashable, so it can be static under jit."""

    architecture: str  # the Hugging Face name of its cbjax.models.registry entry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q/k/v projections
    attention_out_bias: bool  # bias on o_proj (Llama/Qwen3 `attention_bias`; never for Qwen2)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm of q and k before RoPE
    dtype: str  # the checkpoint's own dtype, one of SUPPORTED_DTYPES
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    # Mixture-of-experts (Qwen3-MoE, Mixtral); num_experts=0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts (the rest: intermediate_size, dense)
    # Each layer's sliding window (a query at p sees keys at positions > p - window), None: full
    # attention; () when no layer has one.
    sliding_windows: tuple[int | None, ...] = ()

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} does not exist; pass a Hugging Face model directory or a converted checkpoint")
        return cls.from_hf_config(json.loads(config_path.read_text()))

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a transformers 4.x or 5.x config.json dict; reject what the engine cannot run exactly."""
        entry = architecture_of_hf_config(hf)
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; supported: 'silu'")
        num_attention_heads = hf["num_attention_heads"]
        num_key_value_heads = hf.get("num_key_value_heads") or num_attention_heads
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not a multiple of "
                f"num_key_value_heads={num_key_value_heads}; grouped-query attention needs it to be"
            )
        rope_theta, rope_scaling = _rope(hf)
        eos = hf.get("eos_token_id")
        return cls(
            architecture=entry.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_attention_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **entry.config_fields(hf),
            dtype=_dtype(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            sliding_windows=_sliding_windows(hf, entry.sliding_window_layers),
        )


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """RoPE base and scaling from 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; only full rotary (1.0) is")
    if rope_type == "default":
        return rope_theta, RopeScaling()
    if rope_type == "linear":
        return rope_theta, RopeScaling("linear", factor=float(params["factor"]))
    return rope_theta, RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
        ),
    )


def _sliding_windows(hf: dict[str, Any], family_layers: Callable[[dict[str, Any]], list[bool]]) -> tuple[int | None, ...]:
    """Each layer's window: from 4.x/5.x `layer_types` where the config has them, else the family's
    rule (the registry's sliding_window_layers). A window at least max_position_embeddings long
    never masks anything, so it is dropped (full attention, the same outputs, the faster kernels)."""
    window = hf.get("sliding_window")
    if window is None or window >= hf.get("max_position_embeddings", 2048):
        return ()
    if hf.get("layer_types") is not None:
        windowed = [kind == "sliding_attention" for kind in hf["layer_types"]]
    else:
        windowed = family_layers(hf)
    return tuple(int(window) if w else None for w in windowed) if any(windowed) else ()


def _dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} in config.json is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return dtype
