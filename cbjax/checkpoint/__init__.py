"""Hugging Face -> orbax conversion and loading of Llama-family checkpoints."""

from cbjax.checkpoint.convert import convert_checkpoint
from cbjax.checkpoint.loader import load_model

__all__ = ["convert_checkpoint", "load_model"]
