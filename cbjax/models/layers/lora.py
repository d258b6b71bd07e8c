"""Batched multi-LoRA on the decoder's projections: every adapter slot's factors on the device, one slot per token.

A projection with LoRA slots adds, for each token, x @ A[s].T @ B[s] of its slot s; slot 0 is the base
model, which adds nothing (it has no row: its tokens match none). One step's tokens may use different
slots; `lora_delta` computes all of them at once. A fused projection (qkv_proj, gate_up_proj) holds
its parts' A side by side (one dot in) and a B per part (one dot out each, into its own columns).
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
    x: Float[Array, "tokens in"], a: Float[Array, "parts slots rank in"], bs: list[Float[Array, "slots rank part_out"]],
    token_slots: Int[Array, "tokens"],
) -> Float[Array, "tokens out"]:
    """Per token, its slot's (x @ A.T) @ B for every part, the parts' columns side by side (slot 0: zeros).

    One dot into every slot's rank columns, the columns of the token's other slots zeroed, one dot out
    per part. Exact, and the same dots whatever the mix of slots; it reads every slot's factors, which
    for a few resident adapters costs less than gathering each token's own (jax.lax.ragged_dot over
    tokens sorted by slot pays a sort and an unsort per projection)."""
    num_parts, num_slots, rank, fan_in = a.shape
    xa = jnp.dot(x.astype(a.dtype), a.reshape(-1, fan_in).T, preferred_element_type=x.dtype)
    mine = token_slots[:, None] - 1 == jnp.arange(num_slots * rank, dtype=token_slots.dtype)[None, :] // rank
    xa = jnp.where(mine[:, None, :], xa.reshape(-1, num_parts, num_slots * rank), 0)
    return jnp.concatenate([jnp.dot(xa[:, j].astype(b.dtype), b.reshape(num_slots * rank, -1), preferred_element_type=x.dtype)
                            for j, b in enumerate(bs)], axis=-1)


class LoRASlots(nnx.Module):
    """One projection's LoRA factors in every adapter slot: a [parts, slots, rank, in], and per part
    b [slots, rank, part_out]. `parts`: the checkpoint projections it holds ("self_attn.q_proj", ...)
    and each one's output columns, in order. Slot s (1..slots) is row s - 1."""

    def __init__(self, num_slots: int, rank: int, fan_in: int, parts: tuple[tuple[str, int], ...], dtype: jnp.dtype):
        self.parts = parts
        self.a = LoRAWeight(jnp.zeros((len(parts), num_slots, rank, fan_in), dtype))
        self.b = nnx.List([LoRAWeight(jnp.zeros((num_slots, rank, width), dtype)) for _, width in parts])
        self.token_slots: LoRATokenSlots | None = nnx.data(None)  # data: set to a Variable inside the step

    def __call__(self, x: Float[Array, "tokens in"]) -> Float[Array, "tokens out"]:
        if self.token_slots is None:
            raise RuntimeError("a LoRA projection was called without token slots; call set_token_slots(model, ...) first")
        return lora_delta(x, self.a[...], [b[...] for b in self.b], self.token_slots[...])


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
    """Give every dense q/k/v/o and gate/up/down projection of `model`'s layers `num_slots` adapter slots
    of `rank` (zeros), beside slot 0 (the base model). Returns the fan-in of each (layer, checkpoint
    projection) an adapter may target."""
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
