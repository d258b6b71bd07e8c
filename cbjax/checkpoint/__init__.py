"""Hugging Face -> orbax conversion and loading of checkpoints of every registered architecture.

`convert_checkpoint` and `load_model` are imported on first use (PEP 562): the JAX-free modules
here (resolve.py, gguf_import.py) stay importable from a front end that never loads JAX.
"""

import importlib

_LAZY = {"convert_checkpoint": "cbjax.checkpoint.convert", "load_model": "cbjax.checkpoint.loader"}

__all__ = ["convert_checkpoint", "load_model"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
