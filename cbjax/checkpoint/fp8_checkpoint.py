"""Hugging Face checkpoints whose linear weights are fp8, as vLLM loads them: quantization_config's quant_method
"fp8" (vLLM's own and AutoFP8's), "compressed-tensors" with float 8-bit weights (llm-compressor's FP8,
FP8_DYNAMIC and FP8_BLOCK schemes) and "modelopt" with quant_algo FP8. Each fp8 weight has its scale beside it,
w = q * scale:

    ...q_proj.weight            F8_E4M3 (or F8_E5M2) [out, in]
    ...q_proj.weight_scale      float [] or [1] (per tensor), [out] or [out, 1] (per output channel)
    ...q_proj.weight_scale_inv  float [ceil(out / b0), ceil(in / b1)] per block, b = quantization_config's
                                weight_block_size (compressed-tensors: the weights' block_structure)
    ...q_proj.input_scale       a static activation scale for fp8 x fp8 matmuls: not used here

Served from its directory (resolve.py), the decoder projections stay fp8 as stored: each kernel [in, out] in
float8_e4m3fn with float32 `scales` beside it, [out] (per tensor or row) or [in / b1, out] (per block), which the
int8 products read (kernels_cpu/quant.py; on a CPU the packed C++ kernel widens the fp8 codes in registers):
a byte a weight. Where a block does not divide a projection's inputs, its fused partners are not fp8 too, or
the weight is not a decoder projection (an expert, the LM head), it is dequantized at load, as `cbjax convert`
dequantizes all of them (float32 q * scale, one rounding, then the model's dtype). Their rounding stays, so such
a checkpoint is not quantized again (check_not_requantized). Its KV-cache scales are read beside
(kv_scale_tensors.py). Other quantization methods (GPTQ, AWQ, bitsandbytes, compressed-tensors' integer
schemes) are refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from cbjax.checkpoint.safetensors_io import RAW_DTYPES

logger = logging.getLogger(__name__)

FP8_DTYPES = tuple(RAW_DTYPES.values())
STORED = np.dtype(ml_dtypes.float8_e4m3fn)  # the fp8 type the kernels read (e5m2 weights are dequantized)
# A decoder layer's own projection (not a MoE expert's): the weights kept as stored.
_PROJECTION = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj\.weight")
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


def kept_scales_shape(name: str, dtype: np.dtype, shape: tuple[int, ...], scale_shape: tuple[int, ...],
                      block: tuple[int, int] | None) -> tuple[int, ...] | None:
    """The shape of the `...scales` an fp8 weight `name` [out, in] is kept with as stored, beside its [in, out] kernel:
    [out] per tensor or row, [in / b1, out] per block; None where it is dequantized at load (not a decoder
    projection's e4m3 matrix, a block not dividing `in`, or a scale of another shape: dequantize says why)."""
    if np.dtype(dtype) != STORED or len(shape) != 2 or not _PROJECTION.fullmatch(name):
        return None
    rows, cols = shape
    scale_shape = tuple(scale_shape)
    if math.prod(scale_shape) == 1 or scale_shape in ((rows,), (rows, 1)):
        return (rows,)
    if block is not None and cols % block[1] == 0 and scale_shape == (-(-rows // block[0]), cols // block[1]):
        return (cols // block[1], rows)
    return None


def stored_scales(scale: np.ndarray, shape: tuple[int, ...], block: tuple[int, int] | None) -> np.ndarray:
    """An fp8 weight's scale as the int8 products take it, in kept_scales_shape's `shape`: per tensor or row
    [out], per block [in / b1, out] (each block row's scale repeated over its b0 outputs)."""
    scale = np.asarray(scale, np.float32)
    if len(shape) == 1:
        return np.full(shape, scale.reshape(()), np.float32) if scale.size == 1 else np.ascontiguousarray(scale.reshape(shape))
    return np.ascontiguousarray(np.repeat(scale, block[0], 0)[: shape[1]].T)


def dequantized_tensors(tensors: Iterable[tuple[str, np.ndarray]], scales: dict[str, np.ndarray],
                        block: tuple[int, int] | None, source: str, keep: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with the scales beside its fp8 weights left out and each fp8 weight dequantized to
    float32, or, with `keep`, a decoder projection's e4m3 weight kept with its `...scales` (stored_scales) after it
    where they fit; one log line at the end counts both."""
    kept = dequantized = 0
    for name, tensor in tensors:
        if name.endswith(UNUSED_SUFFIXES) or any(name.endswith(".weight" + s) for s in SCALE_SUFFIXES):
            continue
        if tensor.dtype in FP8_DTYPES:
            if name not in scales:
                raise ValueError(f"{source}: {name} is {tensor.dtype} without a scale beside it ({name}_scale or "
                                 f"{name}_scale_inv); the checkpoint is incomplete")
            shape = kept_scales_shape(name, tensor.dtype, tensor.shape, scales[name].shape, block) if keep else None
            if shape is not None:
                yield name, tensor
                yield name.removesuffix("weight") + "scales", stored_scales(scales[name], shape, block)
                kept += 1
                continue
            tensor = dequantize(name, tensor, scales[name], block, source)
            dequantized += 1
        yield name, tensor
    if kept or dequantized:
        logger.info("%s: %d fp8 projections kept as stored, %d fp8 weights dequantized at load", source, kept,
                    dequantized)


def serves_as_stored(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a Hugging Face directory holding fp8 weights (a quantization_config with fp8 weights),
    which it serves from its own files as stored rather than through a float conversion; False for anything else
    (a file, a preset name, a directory without config.json)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return False
    return quantized_weights(json.loads(config_path.read_text())) in ("fp8", "compressed-tensors", "modelopt")


def unfused_parts(kept: Iterable[str], num_layers: int) -> Iterator[str]:
    """Of the kept fp8 projections (parameter prefixes, `model.layers.0.self_attn.q_proj.`), those in a fused group
    (q/k/v, gate/up) whose other parts are float: dequantized at load, as a fused kernel has one form
    (linear.fuse_projections)."""
    from cbjax.models.layers.linear import FUSED_PROJECTIONS  # JAX: only a load needs it (resolve.py reads this file)

    kept = set(kept)
    for layer in range(num_layers):
        for parts in FUSED_PROJECTIONS.values():
            prefixes = [f"model.layers.{layer}.{part}." for part in parts]
            stored = [prefix for prefix in prefixes if prefix in kept]
            yield from stored if len(stored) < len(prefixes) else ()


def dequantize_unfused_parts(params: dict[str, np.ndarray], num_layers: int, dtype: np.dtype) -> None:
    """Dequantize (float32 q * scales, then `dtype`) the kept fp8 parts of a fused group whose other parts are float
    (unfused_parts)."""
    kept = [name.removesuffix("scales") for name in params if name.endswith(".scales")]
    for prefix in list(unfused_parts(kept, num_layers)):
        q, scales = params[prefix + "kernel"], params.pop(prefix + "scales")  # [in, out]; [out] or [in / G, out]
        rows = np.repeat(scales, q.shape[0] // scales.shape[0], 0) if scales.ndim == 2 else scales
        params[prefix + "kernel"] = (q.astype(np.float32) * rows).astype(dtype)
