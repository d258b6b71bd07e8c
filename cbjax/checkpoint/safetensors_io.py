"""Read a Hugging Face model directory's safetensors, one tensor at a time (bounded memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

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


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, array) for every tensor; only one is materialized at a time."""
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
