"""Hugging Face checkpoints whose linear weights are fp8, as vLLM loads them: quantization_config's quant_method
"fp8" (vLLM's own and AutoFP8's), "compressed-tensors" with float 8-bit weights (llm-compressor's FP8,
FP8_DYNAMIC and FP8_BLOCK schemes) and "modelopt" with quant_algo FP8. Each fp8 weight has its scale beside it,
w = q * scale:

    ...q_proj.weight            F8_E4M3 (or F8_E5M2) [out, in]
    ...q_proj.weight_scale      float [] or [1] (per tensor), [out] or [out, 1] (per output channel)
    ...q_proj.weight_scale_inv  float [ceil(out / b0), ceil(in / b1)] per block, b = quantization_config's
                                weight_block_size (compressed-tensors: the weights' block_structure)
    ...q_proj.input_scale       a static activation scale for fp8 x fp8 matmuls: not used here

cbjax has no fp8 matmul: each weight is dequantized at load (float32, then the model's dtype) and the model
serves float weights; a conversion writes them as floats. Their rounding stays, so such a checkpoint is not
quantized again (check_not_requantized). Its KV-cache scales are read beside (kv_scale_tensors.py). Other
quantization methods (GPTQ, AWQ, bitsandbytes, compressed-tensors' integer schemes) are refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from cbjax.checkpoint.safetensors_io import RAW_DTYPES

logger = logging.getLogger(__name__)

FP8_DTYPES = tuple(RAW_DTYPES.values())
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # beside a weight: `name.weight` + suffix
UNUSED_SUFFIXES = (".input_scale",)
SUPPORTED = "float checkpoints, fp8-weight ones (quant_method 'fp8', 'compressed-tensors' FP8 schemes, 'modelopt' FP8) and GGUF files"


def _weights_of(group: dict[str, Any]) -> dict[str, Any]:
    return group.get("weights") or {}


def fp8_block_size(hf_config: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The weights' block size where their scales are per block, else None; a ValueError for a quantization_config
    whose weights are not fp8, naming its method and what loads."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    block = None
    if method == "fp8":
        block = quant.get("weight_block_size")
    elif method == "compressed-tensors":
        for name, group in (quant.get("config_groups") or {}).items():
            weights = _weights_of(group)
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ValueError(f"{source}: quantization_config group {name!r} has {weights.get('num_bits')}-bit "
                                 f"{weights.get('type')} weights; cbjax loads {SUPPORTED}")
            block = weights.get("block_structure") or block
    elif method == "modelopt":
        if str(quant.get("quant_algo", "")).upper() != "FP8":
            raise ValueError(f"{source}: quantization_config quant_algo {quant.get('quant_algo')!r}; cbjax loads {SUPPORTED}")
    else:
        raise ValueError(f"{source}: quantization_config quant_method {method!r} is not supported; cbjax loads "
                         f"{SUPPORTED}. Serve a float or GGUF copy of the model")
    return None if block is None else (int(block[0]), int(block[1]))


def quantized_weights(hf_config: dict[str, Any]) -> str | None:
    """The quantization_config's method where it quantizes weights (not one that only holds KV-cache scales)."""
    quant = hf_config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method == "compressed-tensors" and not any(_weights_of(g) for g in (quant.get("config_groups") or {}).values()):
        return None
    return method


def check_not_requantized(hf_config: dict[str, Any], quantization: str | None, source: str) -> None:
    method = quantized_weights(hf_config)
    if quantization is not None and method is not None:
        raise ValueError(f"{source} holds weights already quantized (quantization_config quant_method {method!r}), "
                         f"dequantized at load; quantization={quantization!r} would round them a second time: drop "
                         "quantization=, or quantize the float checkpoint they were made from")


def weight_scales(files: Iterable[Path]) -> dict[str, np.ndarray]:
    """Every fp8 weight's scale tensor, by the weight's name (`....weight`); small, read before the weights."""
    scales: dict[str, np.ndarray] = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                suffix = next((s for s in SCALE_SUFFIXES if name.endswith(".weight" + s)), None)
                if suffix is not None:
                    scales[name.removesuffix(suffix)] = f.get_tensor(name)
    return scales


def dequantize(name: str, q: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None, source: str) -> np.ndarray:
    """q * scale in float32 (q widened exactly, one rounding), scale per tensor, per output row or per block."""
    q = q.astype(np.float32)
    scale = np.asarray(scale, np.float32)
    rows, cols = q.shape[-2:] if q.ndim >= 2 else (q.shape[0], 1)
    if scale.size == 1:
        return q * scale.reshape(())
    if scale.shape in ((rows,), (rows, 1)) and q.ndim == 2:
        return q * scale.reshape(rows, 1)
    if block is not None and q.ndim == 2 and scale.shape == (-(-rows // block[0]), -(-cols // block[1])):
        return q * np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:rows, :cols]
    raise ValueError(f"{source}: {name} {tuple(q.shape)} has a scale of shape {tuple(scale.shape)}; cbjax reads fp8 "
                     f"scales per tensor, per output row [{rows}] or per block of quantization_config's "
                     f"weight_block_size ({'none given' if block is None else list(block)})")


def dequantized_tensors(tensors: Iterable[tuple[str, np.ndarray]], scales: dict[str, np.ndarray],
                        block: tuple[int, int] | None, source: str) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each fp8 weight dequantized to float32 and the scales beside them left out;
    one log line at the end counts the dequantized weights."""
    count = 0
    for name, tensor in tensors:
        if name.endswith(UNUSED_SUFFIXES) or any(name.endswith(".weight" + s) for s in SCALE_SUFFIXES):
            continue
        if tensor.dtype in FP8_DTYPES:
            if name not in scales:
                raise ValueError(f"{source}: {name} is {tensor.dtype} without a scale beside it ({name}_scale or "
                                 f"{name}_scale_inv); the checkpoint is incomplete")
            tensor = dequantize(name, tensor, scales[name], block, source)
            count += 1
        yield name, tensor
    if count:
        logger.info("%s: %d fp8 weights dequantized at load (cbjax has no fp8 matmul; they serve as floats)",
                    source, count)
