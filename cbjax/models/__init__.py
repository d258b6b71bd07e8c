"""Llama-family transformer in flax.nnx."""

from cbjax.models.llama import LlamaForCausalLM, init_kv_pool, kv_cache_bytes_per_block

__all__ = ["LlamaForCausalLM", "init_kv_pool", "kv_cache_bytes_per_block"]
