"""Every architecture cbjax serves, and everything the rest of the engine asks of one.

Adding a family is one model file in cbjax/models/ plus one `Architecture` entry in ARCHITECTURES:
how its config.json reads (the family's own fields), its Hugging Face weight names, its GGUF names
(if the importer takes the family), how tensor parallelism splits it, its KV layout, and the class
that builds it. Config parsing, checkpoint loading, sharding, `cbjax lower` and `cbjax plan` ask
here by `ModelConfig.architecture`; none of them names a family.

No JAX here (the front end reads ModelConfig): the model class is named by its import path and
imported only when a model is built, as vLLM's registry does.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cbjax.models.config import ModelConfig

# Buffers some checkpoints carry that are recomputed from the config, never loaded.
RECOMPUTED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection in an HF checkpoint (`mlp.experts.3.gate_proj.weight`): the model holds
# each projection of all experts as one kernel [num_experts, in, out], this tensor at index 3.
EXPERT_WEIGHT = re.compile(r"(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight")


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """How Megatron-style tensor parallelism splits a family's parameters, by nnx module name.

    Column-parallel kernels [in, out] split their output columns (and biases), row-parallel ones
    their input rows (biases replicated: added after the all-reduce); everything else is replicated,
    except the embedding and LM head, split by vocabulary where it divides.
    """

    column_parallel: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    row_parallel: tuple[str, ...] = ("o_proj", "down_proj")
    # Modules whose last axis is KV heads x head_dim: repeated head by head when there are fewer KV
    # heads than devices, so each device holds one.
    kv_head_columns: tuple[str, ...] = ("k_proj", "v_proj")


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV of a model: per layer a K and a V page array, all layers in one pool array each.

    Pool layout (init_kv_pool): [kv_heads, num_layers * num_blocks, block_size, head_dim]; layer l's
    copy of block b is page l * num_blocks + b.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (self.num_kv_heads, self.num_layers * num_blocks, block_size, self.head_dim)

    def bytes_per_block(self, block_size: int, dtype: Any) -> int:
        """Bytes one block id costs across all layers (K and V): what pool sizing divides memory by."""
        return 2 * self.num_layers * self.num_kv_heads * block_size * self.head_dim * np.dtype(dtype).itemsize


def every_layer_full_attention(config: ModelConfig) -> KVCacheSpec:
    """Every layer keeps K and V of all its KV heads for every token."""
    return KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)


@dataclasses.dataclass(frozen=True)
class GGUFNames:
    """How a GGUF file of the family names its tensors (`blk.N.<layer tensor>`), and the HF names they take."""

    architecture: str  # GGUF general.architecture
    global_tensors: Mapping[str, str]
    layer_tensors: Mapping[str, str]
    required_global: tuple[str, ...]  # GGUF names a file must hold (others, e.g. an untied head, may be absent)


def _no_layer(hf: dict[str, Any]) -> list[bool]:
    return [False] * hf["num_hidden_layers"]


def _every_layer(hf: dict[str, Any]) -> list[bool]:
    return [True] * hf["num_hidden_layers"]


def _windowed_from_max_window_layers(hf: dict[str, Any]) -> list[bool]:
    """Qwen2/3 (4.x configs without layer_types): the window applies only when enabled, from max_window_layers on."""
    enabled, first = bool(hf.get("use_sliding_window")), hf.get("max_window_layers", 0)
    return [enabled and layer >= first for layer in range(hf["num_hidden_layers"])]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One family: what the engine asks of it, and the class (by import path) that builds it."""

    name: str  # Hugging Face `architectures[0]`
    model_type: str  # Hugging Face `model_type` (config.json files without "architectures" still name it)
    model_class: str  # "module:Class", imported when a model is built
    # The family's own ModelConfig fields, read from config.json (attention_bias, attention_out_bias, mlp_bias,
    # qk_norm, and the mixture-of-experts fields).
    config_fields: Callable[[dict[str, Any]], dict[str, Any]]
    # Which layers a config's sliding window applies to, per layer, for configs without 4.x/5.x `layer_types`.
    sliding_window_layers: Callable[[dict[str, Any]], list[bool]] = _no_layer
    tensor_parallel: TensorParallelPlan = TensorParallelPlan()
    kv_cache: Callable[[ModelConfig], KVCacheSpec] = every_layer_full_attention
    gguf: GGUFNames | None = None  # None: `cbjax import-gguf` does not take the family
    # HF module names the model calls by the names other families use (Mixtral's block_sparse_moe.w1 is
    # mlp.gate_proj), so one model class and one tensor-parallel plan serve both.
    hf_module_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # transformers' defaults for the config.json keys a file may leave out, where they differ from what
    # ModelConfig.from_hf_config assumes (Llama's): a key the file omits means the family's default.
    hf_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def load_class(self) -> type:
        module, _, cls = self.model_class.partition(":")
        return getattr(importlib.import_module(module), cls)

    def param_slot(self, hf_name: str, ndim: int, tie_word_embeddings: bool) -> tuple[str, int | None] | None:
        """Our parameter name for an HF tensor and, for one expert's projection, its index in the stacked
        kernel (else None); None for tensors the model does not load. Module names mirror HF's (after
        hf_module_names), so the rule is one per parameter kind: nn.Linear's 2-D weight is nnx's kernel."""
        if hf_name.endswith(RECOMPUTED_HF_SUFFIXES):
            return None
        if hf_name == "lm_head.weight" and tie_word_embeddings:
            return None  # some tied checkpoints still store the head; it equals the embedding
        if hf_name == "model.embed_tokens.weight":
            return "model.embed_tokens.embedding", None
        hf_name = ".".join(self.hf_module_names.get(part, part) for part in hf_name.split("."))
        expert = EXPERT_WEIGHT.fullmatch(hf_name)
        if expert and ndim == 2:
            return f"{expert['experts']}.{expert['projection']}.kernel", int(expert["index"])
        if ndim == 3 and hf_name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return hf_name + ".kernel", None  # transformers 5's in-memory layout: all experts in one tensor
        if hf_name.endswith(".weight") and ndim == 2:
            return hf_name.removesuffix(".weight") + ".kernel", None
        return hf_name, None


def _llama_fields(hf: dict[str, Any]) -> dict[str, bool]:
    attention_bias = bool(hf.get("attention_bias", False))
    return dict(attention_bias=attention_bias, attention_out_bias=attention_bias,
                mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=False)


def _qwen2_fields(hf: dict[str, Any]) -> dict[str, bool]:
    """Biases on q/k/v always, never on o_proj."""
    return {**_llama_fields(hf), "attention_bias": True, "attention_out_bias": False}


def _qwen3_fields(hf: dict[str, Any]) -> dict[str, bool]:
    """Per-head RMSNorm of q and k before RoPE."""
    return {**_llama_fields(hf), "qk_norm": True}


def _olmo2_fields(hf: dict[str, Any]) -> dict[str, bool]:
    """No MLP biases; its q/k norms (over the whole projection) are the model file's, not `qk_norm`'s per-head ones."""
    return {**_llama_fields(hf), "mlp_bias": False}


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Per-head q/k norms, scores scaled by query_pre_attn_scalar, optionally capped logits; no attention path
    caps scores, so a config that asks for it is refused."""
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping={hf['attn_logit_softcapping']} is not supported: no attention "
                         "backend caps attention scores; only configs with attn_logit_softcapping null (Gemma 3's) load")
    return {**_qwen3_fields(hf), "query_pre_attn_scalar": float(hf["query_pre_attn_scalar"]),
            "final_logit_softcapping": hf.get("final_logit_softcapping")}


def _every_nth_layer_global(hf: dict[str, Any]) -> list[bool]:
    """Gemma 3 (configs without layer_types): every sliding_window_pattern-th layer is global, the rest slide."""
    pattern = hf.get("sliding_window_pattern", 6)
    return [(layer + 1) % pattern != 0 for layer in range(hf["num_hidden_layers"])]


def _qwen3_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3's attention; experts in every `decoder_sparse_step`-th layer except `mlp_only_layers` (dense,
    intermediate_size wide), as transformers' Qwen3MoeDecoderLayer picks them."""
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # transformers 5 writes the latter
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    sparse = tuple(layer for layer in range(hf["num_hidden_layers"])
                   if num_experts and layer not in dense and (layer + 1) % step == 0)
    return {**_qwen3_fields(hf), "num_experts": num_experts, "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"], "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "sparse_layers": sparse}


def _mixtral_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's attention; experts (intermediate_size wide) in every layer, top-k weights renormalized."""
    return {**_llama_fields(hf), "num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True,
            "sparse_layers": tuple(range(hf["num_hidden_layers"]))}


# Gemma3TextConfig's defaults (transformers 4.x and 5.x) that differ from Llama's.
GEMMA3_HF_DEFAULTS = dict(
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, head_dim=256, max_position_embeddings=131072,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=4096, sliding_window_pattern=6,
    query_pre_attn_scalar=256, vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, bos_token_id=2, eos_token_id=1,
)

LLAMA_GGUF = GGUFNames(
    architecture="llama",
    global_tensors={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    layer_tensors={
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
    required_global=("token_embd.weight", "output_norm.weight"),
)

ARCHITECTURES: dict[str, Architecture] = {entry.name: entry for entry in (
    Architecture("LlamaForCausalLM", "llama", "cbjax.models.llama:LlamaForCausalLM", _llama_fields, gguf=LLAMA_GGUF),
    Architecture("MistralForCausalLM", "mistral", "cbjax.models.llama:LlamaForCausalLM", _llama_fields,
                 sliding_window_layers=_every_layer),
    Architecture("Qwen2ForCausalLM", "qwen2", "cbjax.models.llama:LlamaForCausalLM", _qwen2_fields,
                 sliding_window_layers=_windowed_from_max_window_layers),
    Architecture("Qwen3ForCausalLM", "qwen3", "cbjax.models.llama:LlamaForCausalLM", _qwen3_fields,
                 sliding_window_layers=_windowed_from_max_window_layers),
    # q/k norms span every head, so k_norm's scale repeats with its KV heads.
    Architecture("Olmo2ForCausalLM", "olmo2", "cbjax.models.olmo2:Olmo2ForCausalLM", _olmo2_fields,
                 tensor_parallel=TensorParallelPlan(kv_head_columns=("k_proj", "v_proj", "k_norm"))),
    # Local (sliding, own RoPE base) and global layers; Gemma's norms, embedding scale and GELU-tanh MLP.
    Architecture("Gemma3ForCausalLM", "gemma3_text", "cbjax.models.gemma3:Gemma3ForCausalLM", _gemma3_fields,
                 sliding_window_layers=_every_nth_layer_global, hf_defaults=GEMMA3_HF_DEFAULTS),
    # Mixture-of-experts: Llama's layers whose MLP is a router and stacked experts (models/layers/moe.py).
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "cbjax.models.llama:LlamaForCausalLM", _qwen3_moe_fields,
                 sliding_window_layers=_windowed_from_max_window_layers),
    Architecture("MixtralForCausalLM", "mixtral", "cbjax.models.llama:LlamaForCausalLM", _mixtral_fields,
                 sliding_window_layers=_every_layer,
                 hf_module_names={"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
)}


def architecture(name: str) -> Architecture:
    """The entry of `name` (an HF architecture), or a ValueError naming the supported ones."""
    entry = ARCHITECTURES.get(name)
    if entry is None:
        raise ValueError(f"architecture {name} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return entry


def architecture_of_hf_config(hf: dict[str, Any]) -> Architecture:
    """The entry a config.json dict names, by `architectures` or else by `model_type`."""
    names = hf.get("architectures")
    if names:
        return architecture(names[0])
    by_model_type = {entry.model_type: entry for entry in ARCHITECTURES.values()}
    model_type = hf.get("model_type", "")
    if model_type not in by_model_type:
        raise ValueError(f"architecture model_type={model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return by_model_type[model_type]


def model_class(config: ModelConfig) -> type:
    """The nnx class that builds `config`'s model (imports it, and so JAX)."""
    return architecture(config.architecture).load_class()


def kv_cache_spec(config: ModelConfig) -> KVCacheSpec:
    return architecture(config.architecture).kv_cache(config)


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: Any) -> int:
    """Bytes one block id costs across all layers (K and V): what pool sizing divides memory by."""
    return kv_cache_spec(config).bytes_per_block(block_size, dtype)


def gguf_architecture(gguf_name: str) -> Architecture | None:
    """The entry whose GGUF files declare general.architecture=`gguf_name`, if the importer takes one."""
    return next((entry for entry in ARCHITECTURES.values() if entry.gguf and entry.gguf.architecture == gguf_name), None)
