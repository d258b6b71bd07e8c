"""An fp8 checkpoint served as stored (fp8_checkpoint.py), as the parameters a load makes of it, in shapes and
dtypes read from its files' headers: what `cbjax plan` counts for it."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from cbjax.checkpoint.fp8_checkpoint import SCALE_SUFFIXES, STORED, fp8_block_size, kept_scales_shape, unfused_parts
from cbjax.checkpoint.params import expected_params
from cbjax.checkpoint.safetensors_io import RAW_DTYPES, safetensors_files, tensor_shapes
from cbjax.models.config import ModelConfig
from cbjax.models.registry import architecture


def fp8_stored_shapes(model_dir: str | Path, config: ModelConfig, dtype: str | jnp.dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """The parameters read_hf_params(keep_fp8=True) makes of `model_dir`, no tensor data read: each decoder
    projection kept as stored an e4m3 kernel with float32 `scales` beside ([out], or [in / b, out] per block),
    everything else (dequantized fp8 weights among them) in `dtype`."""
    model_dir = Path(model_dir)
    block = fp8_block_size(json.loads((model_dir / "config.json").read_text()), str(model_dir))
    tensors = tensor_shapes(safetensors_files(model_dir))
    slots = architecture(config.architecture)
    kept: dict[str, tuple[int, ...]] = {}  # kernel's prefix -> its scales' shape
    for name, (stored, shape) in tensors.items():
        scale = next((tensors[name + suffix][1] for suffix in SCALE_SUFFIXES if name + suffix in tensors), None)
        if scale is None or stored not in RAW_DTYPES:
            continue
        scales_shape = kept_scales_shape(name, RAW_DTYPES[stored], shape, scale, block)
        slot = slots.param_slot(name, len(shape), config.tie_word_embeddings)
        if scales_shape is not None and slot is not None:
            kept[slot[0].removesuffix("kernel")] = scales_shape
    for prefix in list(unfused_parts(kept, config.num_hidden_layers)):
        del kept[prefix]
    shapes = expected_params(config, jnp.dtype(dtype))
    for prefix, scales_shape in kept.items():
        shapes[prefix + "kernel"] = jax.ShapeDtypeStruct(shapes[prefix + "kernel"].shape, STORED)
        shapes[prefix + "scales"] = jax.ShapeDtypeStruct(scales_shape, jnp.float32)
    return shapes
