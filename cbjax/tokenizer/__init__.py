"""The model's tokenizer (Hugging Face `tokenizers`), incremental detokenization and chat templates."""

from cbjax.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
