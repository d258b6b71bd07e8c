"""Paged attention over the KV block pool: Pallas kernels and their jnp references."""

from kernels_pallas.reference import AttentionMetadata, write_kv

__all__ = ["AttentionMetadata", "write_kv"]
