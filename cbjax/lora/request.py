"""LoRARequest: which adapter a request runs under (vLLM's class and field names). No JAX."""

from __future__ import annotations

import dataclasses
import os

from cbjax.arguments import ArgumentTypeError, check_int, describe


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a unique positive id (the engine's key: the prefix cache and the device
    slots tell adapters apart by it) and the PEFT directory it is read from
    (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ArgumentTypeError(f"lora_name must be a non-empty str, got {describe(self.lora_name)}")
        check_int("lora_int_id", self.lora_int_id)
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str):
            raise ArgumentTypeError(f"lora_path must be a str or path, got {describe(self.lora_path)}")


def check_lora_request(lora_request: object) -> LoRARequest | None:
    """`lora_request` if it is a LoRARequest or None; ArgumentTypeError otherwise."""
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise ArgumentTypeError(f"lora_request must be a LoRARequest or None, got {describe(lora_request)}")
    return lora_request
