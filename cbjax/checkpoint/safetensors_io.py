"""Read a Hugging Face model directory's safetensors, one tensor at a time (bounded memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The weight files of hf_dir: the shards its index names, or every *.safetensors file."""
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [shard for shard in shards if not (hf_dir / shard).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {hf_dir}: {', '.join(missing)}")
        return [hf_dir / shard for shard in shards]
    files = sorted(hf_dir.glob("*.safetensors"))
    if files:
        return files
    if list(hf_dir.glob("*.bin")) or list(hf_dir.glob("*.pt")) or list(hf_dir.glob("*.pth")):
        raise ValueError(
            f"{hf_dir} holds only PyTorch pickle weights (*.bin/*.pt); cbjax reads safetensors only. Convert with "
            f"transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}; pass a Hugging Face model directory")


def count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(path, framework="numpy") as f:
            total += len(f.keys())
    return total


# Element types safetensors' numpy reader does not map (numpy has no fp8): read from the file's bytes instead.
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _raw_tensor(path: Path, entry: dict, data_start: int) -> np.ndarray:
    begin, end = entry["data_offsets"]
    data = np.fromfile(path, np.uint8, count=end - begin, offset=data_start + begin)
    return data.view(RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def tensor_shapes(files: list[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor's (safetensors dtype name, "F32", "F8_E4M3", ...; shape) by HF name, from the files' headers
    alone (no tensor data is read)."""
    return {name: (entry["dtype"], tuple(entry["shape"]))
            for path in files for name, entry in _header(path)[0].items() if name != "__metadata__"}


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, array) for every tensor; only one is materialized at a time. fp8 tensors come as
    ml_dtypes' float8 arrays."""
    for path in files:
        header, data_start = _header(path)
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                entry = header[name]
                yield name, _raw_tensor(path, entry, data_start) if entry["dtype"] in RAW_DTYPES else f.get_tensor(name)
