"""`cbjax convert`: a Hugging Face safetensors directory -> an orbax checkpoint directory.

Output layout (`checkpoints/<name>/` by default):
    params/       orbax checkpoint: nested dict of parameters named by nnx path, in our layout
    config.json   the HF config, with "dtype" set to the dtype the params were written in
    kv_scales.json  each layer's fp8 KV-cache scales, where the HF checkpoint has them
    tokenizer and generation files, copied unchanged when present
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from cbjax.checkpoint.fp8_checkpoint import dequantize_unfused_parts, dequantized_tensors, fp8_block_size, weight_scales
from cbjax.checkpoint.kv_scale_tensors import kv_scale_slot, read_kv_scales, write_kv_scales
from cbjax.checkpoint.layout import PARAMS_DIR
from cbjax.checkpoint.params import check_params, convert_hf_tensors, expected_params, nest_params, stack_experts
from cbjax.checkpoint.safetensors_io import count_tensors, iter_tensors, safetensors_files
from cbjax.models.config import SUPPORTED_DTYPES, ModelConfig

COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def resolve_dtype(dtype: str | jnp.dtype | None, config: ModelConfig) -> str:
    """The dtype name to use: the requested one, else the checkpoint's own."""
    name = config.dtype if dtype is None else jnp.dtype(dtype).name
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def read_hf_params(hf_dir: Path, config: ModelConfig, dtype: str, *, progress: bool = True,
                   keep_fp8: bool = False) -> dict[str, np.ndarray]:
    """All parameters of an HF directory in our names, layout and dtype: one model copy, built tensor by tensor.
    fp8 weights are dequantized, or with `keep_fp8` the decoder projections' kept as stored with `...scales`
    beside (fp8_checkpoint.py); fp8 KV-cache scales are not parameters (read_kv_scales)."""
    files = safetensors_files(hf_dir)
    block = fp8_block_size(json.loads((hf_dir / "config.json").read_text()), str(hf_dir))
    tensors = ((name, tensor) for name, tensor in iter_tensors(files) if kv_scale_slot(name) is None)
    hf_tensors = tqdm(dequantized_tensors(tensors, weight_scales(files), block, str(hf_dir), keep=keep_fp8),
                      total=count_tensors(files), desc=f"reading {hf_dir.name}", unit="tensor", disable=not progress)
    params: dict[str, np.ndarray] = {}
    pieces = convert_hf_tensors(hf_tensors, config, jnp.dtype(dtype))
    for name, array in stack_experts(pieces, config.num_experts, str(hf_dir)):
        if name in params:
            raise ValueError(f"tensor {name} appears twice in {hf_dir}; the safetensors shards overlap")
        params[name] = array
    dequantize_unfused_parts(params, config.num_hidden_layers, jnp.dtype(dtype))
    expected = expected_params(config, jnp.dtype(dtype))
    # A kernel kept as stored is checked as the float kernel it stands for (same [in, out] shape), its scales not.
    found = {name: (array.shape, expected[name].dtype if name.removesuffix("kernel") + "scales" in params and
                    name in expected else array.dtype)
             for name, array in params.items() if not name.endswith(".scales")}
    check_params(expected, found, source=str(hf_dir))
    return params


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path | None = None, dtype: str | None = None) -> Path:
    """Convert hf_dir to an orbax checkpoint in out_dir (default checkpoints/<hf_dir name, lowercased>)."""
    import orbax.checkpoint as ocp  # not imported by a load from the weights cache (see weights_cache.py)

    hf_dir = Path(hf_dir)
    config = ModelConfig.from_dir(hf_dir)
    dtype = resolve_dtype(dtype, config)
    out_dir = Path(out_dir) if out_dir is not None else Path("checkpoints") / hf_dir.resolve().name.lower()
    params_dir = (out_dir / PARAMS_DIR).resolve()
    if params_dir.exists():
        raise FileExistsError(f"{params_dir} already exists; delete it or pass another out_dir")

    kv_scales = read_kv_scales(hf_dir, config.num_hidden_layers)  # refused, where they must be, before the weights
    params = read_hf_params(hf_dir, config, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(params_dir, nest_params(params))
        checkpointer.wait_until_finished()

    hf_config = json.loads((hf_dir / "config.json").read_text())
    hf_config["dtype"] = dtype
    if "torch_dtype" in hf_config:  # keep 4.x readers consistent with what was written
        hf_config["torch_dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for file_name in COPIED_FILES:
        if (hf_dir / file_name).is_file():
            shutil.copy2(hf_dir / file_name, out_dir / file_name)
    if kv_scales is not None:
        write_kv_scales(out_dir, kv_scales)
    return out_dir
