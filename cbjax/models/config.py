"""Configuration dataclasses: the model's shape, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

from cbjax.models.registry import architecture_of_hf_config

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (HF hidden_act / hidden_activation)
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
    hidden_act: str = "silu"  # one of SUPPORTED_ACTIVATIONS
    # Gemma: attention scores scale by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None  # Gemma: logits = cap * tanh(logits / cap)
    # Layers that rotate by their own RoPE (Gemma 3's sliding layers: rope_local_base_freq), whatever their
    # window; the rest by rope_theta and rope_scaling.
    local_rope_layers: tuple[int, ...] = ()
    local_rope_theta: float = 10000.0
    local_rope_scaling: RopeScaling = RopeScaling()

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def rope(self, layer: int) -> tuple[float, RopeScaling]:
        """The RoPE base and scaling of `layer`."""
        if layer in self.local_rope_layers:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def sm_scale(self) -> float:
        """What attention scores are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        hf = {**entry.hf_defaults, **hf}
        hidden_act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")  # Gemma names it hidden_activation
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; supported: "
                             f"{', '.join(map(repr, SUPPORTED_ACTIVATIONS))}")
        family_fields = entry.config_fields(hf)
        if family_fields.get("sparse_layers") and hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} with experts is not supported; the experts' MLP is 'silu' only")
        num_attention_heads = hf["num_attention_heads"]
        num_key_value_heads = hf.get("num_key_value_heads") or num_attention_heads
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not a multiple of "
                f"num_key_value_heads={num_key_value_heads}; grouped-query attention needs it to be"
            )
        global_rope, local_rope = _rope_parameters(hf)
        rope_theta, rope_scaling = _rope(global_rope, hf)
        windowed = _windowed_layers(hf, entry.sliding_window_layers)
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
            **family_fields,
            dtype=_dtype(hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            sliding_windows=_sliding_windows(hf, windowed),
            hidden_act=hidden_act,
            **_local_rope(local_rope, windowed, hf),
        )


def _rope_parameters(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The RoPE parameters of full-attention layers and, where the config gives sliding layers their own
    (Gemma 3), theirs: 5.x `rope_parameters` keyed by layer type, or 4.x `rope_scaling` (+ `rope_local_base_freq`)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        return params["full_attention"], params.get("sliding_attention")
    local = {"rope_theta": hf["rope_local_base_freq"]} if "rope_local_base_freq" in hf else None
    return {**(hf.get("rope_scaling") or {}), **params}, local


def _local_rope(local_rope: dict[str, Any] | None, windowed: list[bool], hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of the sliding layers' own RoPE, if the config gives them one."""
    if local_rope is None:
        return {}
    theta, scaling = _rope(local_rope, hf)
    return dict(local_rope_layers=tuple(layer for layer, w in enumerate(windowed) if w),
                local_rope_theta=theta, local_rope_scaling=scaling)


def _rope(params: dict[str, Any], hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of one layer type's parameters (`rope_theta` may sit beside them, in 4.x configs)."""
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


def _windowed_layers(hf: dict[str, Any], family_layers: Callable[[dict[str, Any]], list[bool]]) -> list[bool]:
    """Which layers are sliding-window ones: from 4.x/5.x `layer_types` where the config has them, else
    the family's rule (the registry's sliding_window_layers)."""
    if hf.get("layer_types") is not None:
        return [kind == "sliding_attention" for kind in hf["layer_types"]]
    return family_layers(hf)


def _sliding_windows(hf: dict[str, Any], windowed: list[bool]) -> tuple[int | None, ...]:
    """Each layer's window (None on the full-attention layers). A window at least max_position_embeddings
    long never masks anything, so it is dropped (full attention, the same outputs, the faster kernels)."""
    window = hf.get("sliding_window")
    if window is None or window >= hf.get("max_position_embeddings", 2048):
        return ()
    return tuple(int(window) if w else None for w in windowed) if any(windowed) else ()


def _dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} in config.json is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return dtype
