"""LoRA adapters served beside the base model (vLLM's multi-LoRA): the request form and the PEFT adapter reader."""

from cbjax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
