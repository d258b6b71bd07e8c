"""Batched multi-LoRA on the decoder's projections: every slot's factors on the device, one slot per token.

A projection with LoRA slots adds, for each token, x @ A[s].T @ B[s] of its slot s (slot 0 holds zeros:
the base model). One step's tokens may use different slots; `lora_delta` computes all of them at once.
A fused projection (qkv_proj, gate_up_proj) holds its parts' factors side by side: A's rows part by
part, B block-diagonal (each part's rows write only its own columns), so the product is exact.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from cbjax.models.config import ModelConfig
from cbjax.models.layers.linear import FUSED_PROJECTIONS, Linear


class LoRAWeight(nnx.Variable):
    """A slot's LoRA factors: written while serving (worker/lora_slots.py), never in a checkpoint."""


class LoRATokenSlots(nnx.Variable):
    """Each token's LoRA slot in the step being traced (set by `set_token_slots`)."""


def lora_delta(
    x: Float[Array, "tokens in"], a: Float[Array, "slots rank in"], b: Float[Array, "slots rank out"],
    token_slots: Int[Array, "tokens"],
) -> Float[Array, "tokens out"]:
    """sum over slots s of [token in s] * (x @ a[s].T) @ b[s]: one dot into every slot's rank columns,
    the other slots' columns zeroed per token, one dot out. Exact, and two dots whatever the mix;
    it costs slots x rank columns a token (the alternative, jax.lax.ragged_dot over tokens sorted by
    slot, pays a sort and an unsort per projection)."""
    num_slots, rank, fan_in = a.shape
    xa = jnp.dot(x.astype(a.dtype), a.reshape(num_slots * rank, fan_in).T, preferred_element_type=x.dtype)
    mine = token_slots[:, None] == jnp.arange(num_slots * rank, dtype=token_slots.dtype)[None, :] // rank
    return jnp.dot(jnp.where(mine, xa, 0).astype(b.dtype), b.reshape(num_slots * rank, -1), preferred_element_type=x.dtype)


class LoRASlots(nnx.Module):
    """One projection's LoRA factors in every slot: a [slots, parts * rank, in], b [slots, parts * rank, out].

    `parts`: the checkpoint projections it holds ("self_attn.q_proj", ...) and each one's output
    columns, in order; part j's factors take rows j * rank ... (j + 1) * rank."""

    def __init__(self, num_slots: int, rank: int, fan_in: int, parts: tuple[tuple[str, int], ...], dtype: jnp.dtype):
        self.rank = rank
        self.parts = parts
        width = rank * len(parts)
        self.a = LoRAWeight(jnp.zeros((num_slots, width, fan_in), dtype))
        self.b = LoRAWeight(jnp.zeros((num_slots, width, sum(out for _, out in parts)), dtype))
        self.token_slots: LoRATokenSlots | None = nnx.data(None)  # data: set to a Variable inside the step

    def __call__(self, x: Float[Array, "tokens in"]) -> Float[Array, "tokens out"]:
        if self.token_slots is None:
            raise RuntimeError("a LoRA projection was called without token slots; call set_token_slots(model, ...) first")
        return lora_delta(x, self.a[...], self.b[...], self.token_slots[...])


def projection_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each projection module's LoRA parts and their output widths, by the module's name in a layer
    (fused or not)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    widths = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": config.hidden_size,
              "mlp.gate_proj": config.intermediate_size, "mlp.up_proj": config.intermediate_size,
              "mlp.down_proj": config.hidden_size}
    parts = {name: ((name, width),) for name, width in widths.items()}
    parts.update({fused: tuple((name, widths[name]) for name in names) for fused, names in FUSED_PROJECTIONS.items()})
    return parts


def attach_lora(model: nnx.Module, config: ModelConfig, num_slots: int, rank: int) -> dict[tuple[int, str], int]:
    """Give every dense q/k/v/o and gate/up/down projection of `model`'s layers `num_slots` LoRA slots of
    `rank` (zeros). Returns the fan-in of each (layer, checkpoint projection) an adapter may target."""
    parts_of = projection_parts(config)
    fan_ins = {}
    for index, layer in enumerate(model.model.layers):
        for path, module in nnx.iter_modules(layer):
            name = ".".join(map(str, path))
            if name in parts_of and isinstance(module, Linear):
                fan_in = module.in_features
                module.lora = LoRASlots(num_slots, rank, fan_in, parts_of[name], model.dtype)
                fan_ins.update({(index, part): fan_in for part, _ in parts_of[name]})
    return fan_ins


def lora_modules(model: nnx.Module) -> list[tuple[int, LoRASlots]]:
    """(layer index, slots) of every projection attach_lora gave slots, in layer order."""
    return [(index, module) for index, layer in enumerate(model.model.layers)
            for _, module in nnx.iter_modules(layer) if isinstance(module, LoRASlots)]


def set_token_slots(model: nnx.Module, token_slots: Int[Array, "tokens"]) -> None:
    """Every LoRA projection of `model` adds, for each token, its slot's update (inside a traced step)."""
    for _, module in lora_modules(model):
        module.token_slots = LoRATokenSlots(token_slots)
