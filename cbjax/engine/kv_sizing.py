"""How many KV blocks the pool gets: explicit, a byte budget, or a fraction of device memory."""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)

# XLA:CPU has no device memory to measure: the pool defaults to this budget there.
CPU_DEFAULT_KV_BYTES = 2 << 30


def plan_num_blocks(
    *,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    device: jax.Device,
    reserved_bytes: int = 0,
) -> int:
    """Pool size in blocks (the null block included), checked to hold one max_model_len request.

    `reserved_bytes` is what the step needs besides the pool (activations), from a
    profiled step on GPU. On CPU, without a byte budget, the pool gets
    CPU_DEFAULT_KV_BYTES, capped at what max_num_seqs full-length requests use.
    """
    blocks_per_request = -(-max_model_len // block_size)
    if num_kv_blocks is not None:
        num_blocks, source = num_kv_blocks, "num_kv_blocks"
    elif kv_cache_memory_bytes is not None:
        num_blocks, source = kv_cache_memory_bytes // bytes_per_block, "kv_cache_memory_bytes"
    else:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            free = int(stats["bytes_limit"] * gpu_memory_utilization) - stats.get("bytes_in_use", 0) - reserved_bytes
            num_blocks, source = max(free, 0) // bytes_per_block, f"gpu_memory_utilization={gpu_memory_utilization}"
        else:
            cap = max_num_seqs * blocks_per_request + 1
            num_blocks, source = min(CPU_DEFAULT_KV_BYTES // bytes_per_block, cap), "the CPU default budget"
    if num_blocks - 1 < blocks_per_request:
        largest = (num_blocks - 1) * block_size
        raise ValueError(
            f"the KV pool from {source} has {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * bytes_per_block / 2**20:.1f} MiB), which cannot hold one request of "
            f"max_model_len={max_model_len} ({blocks_per_request} blocks + the null block); "
            f"lower max_model_len to at most {max(largest, 0)} or give the pool more memory"
        )
    logger.info(
        "KV pool: %d blocks x %d tokens (%.1f MiB) from %s",
        num_blocks, block_size, num_blocks * bytes_per_block / 2**20, source,
    )
    return num_blocks
