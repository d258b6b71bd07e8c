"""The paged KV pool every family's attention writes and reads: its arrays, in the registry's layout.

One K and one V array for all layers (cbjax.models.registry.KVCacheSpec.pool_shape): a step's call
passes two pool arrays, not two per layer (JAX's dispatch pays per array).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from cbjax.models.config import ModelConfig
from cbjax.models.registry import kv_cache_spec

KVPages = Float[Array, "kv_heads blocks block_size dim"]
# Every layer's pages: [kv_heads, num_hidden_layers * num_blocks, block_size, head_dim] (init_kv_pool).
KVPool = tuple[KVPages, KVPages]


def init_kv_pool(config: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> KVPool:
    """The zeroed page pool of every layer: (k_pages, v_pages), each [kv_heads, num_hidden_layers *
    num_blocks, block_size, head_dim]; layer l's copy of block b is page l * num_blocks + b."""
    shape = kv_cache_spec(config).pool_shape(num_blocks, block_size)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
