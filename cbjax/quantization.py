"""The names `quantization=` accepts (vLLM's keyword), checked without importing JAX: EngineConfig
checks them in the front end; the weights are quantized at load (cbjax.models.layers.linear)."""

from __future__ import annotations

# int8: weight-only, symmetric per output channel (kernels_cpu/quant.py); int4: weight-only, groups of 128
# inputs per output channel, symmetric or asymmetric per group, whichever is closer (kernels_cpu/quant4.py).
QUANTIZATIONS = ("int8", "int4")


def check_quantization(name: str | None) -> None:
    """Raise naming `name` and the supported ones unless it is None or one of QUANTIZATIONS."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization={name!r} is not supported; use one of {QUANTIZATIONS} or None (no quantization)")
