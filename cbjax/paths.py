"""Where cbjax keeps what it makes once per machine: compiled steps, converted models, built kernels."""

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """$CBJAX_CACHE_DIR, else ~/.cache/cbjax (created on first use)."""
    path = pathlib.Path(os.environ.get("CBJAX_CACHE_DIR") or pathlib.Path.home() / ".cache" / "cbjax")
    path.mkdir(parents=True, exist_ok=True)
    return path
