"""The names `quantization=` accepts (vLLM's keyword), checked without importing JAX: EngineConfig
checks them in the front end; the weights are quantized at load (cbjax.models.layers.linear)."""

from __future__ import annotations

# int8: weight-only, symmetric per output channel (kernels_cpu/quant.py); int4: weight-only, groups of 128
# inputs per output channel (int4-g64, int4-g32: of 64, 32, for models whose widths 128 does not divide, as
# SmolLM2's 576), symmetric or asymmetric per group, whichever is closer (kernels_cpu/quant4.py).
QUANTIZATIONS = ("int8", "int4", "int4-g64", "int4-g32")


def check_quantization(name: str | None) -> None:
    """Raise naming `name` and the supported ones unless it is None or one of QUANTIZATIONS."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization={name!r} is not supported; use one of {QUANTIZATIONS} or None (no quantization)")


def int4_group_size(name: str) -> int:
    """The inputs per group of a 4-bit quantization name: "int4" 128, "int4-gN" N."""
    return int(name.partition("-g")[2] or 128)


def int4_groups_dividing(k: int) -> list[str]:
    """The 4-bit quantization names whose group divides an input width `k`."""
    return [name for name in QUANTIZATIONS if name.startswith("int4") and k % int4_group_size(name) == 0]


def check_quantized_lm_head(quantize_lm_head: bool, quantization: str | None, tensor_parallel_size: int) -> None:
    """Raise unless `quantize_lm_head` comes with a quantization and one device (the loader's, the planner's and
    the abstract lowering's one rule)."""
    if quantize_lm_head and (quantization is None or tensor_parallel_size > 1):
        raise ValueError(
            f"quantize_lm_head=True needs quantization= (got {quantization!r}) and one device (got "
            f"tensor_parallel_size={tensor_parallel_size}): set quantization, or serve the LM head float under tensor "
            "parallelism")
