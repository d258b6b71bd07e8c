"""How many KV blocks the pool gets: explicit, a byte budget, a fraction of GPU memory, or the CPU rule."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # core/ imports no JAX: the device is the caller's (worker/build.py)
    import jax

logger = logging.getLogger(__name__)

# XLA:CPU has no device memory to measure, so the default pool follows the model: half the bytes
# of its weights (a 135M float32 model gets 270 MB, not a fixed 2 GiB), at most CPU_MAX_KV_BYTES.
# Quantized weights count as the float ones they stand for (models/layers/linear.float_equivalent_bytes):
# a smaller pool would preempt more and lose the speed the quantization bought.
CPU_KV_SHARE_OF_WEIGHTS = 0.5
CPU_MAX_KV_BYTES = 2 << 30
# The request length the start-up log line counts concurrency in, besides max_model_len.
TYPICAL_REQUEST_TOKENS = 512
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default

_warned_cpu_utilization = False


def warn_gpu_memory_utilization_on_cpu() -> None:
    """gpu_memory_utilization means nothing on XLA:CPU: say so, once per process."""
    global _warned_cpu_utilization
    if not _warned_cpu_utilization:
        _warned_cpu_utilization = True
        warnings.warn(
            "gpu_memory_utilization is ignored on a CPU (there is no device memory to share); the KV pool "
            "follows the model instead; set kv_cache_memory_bytes or num_kv_blocks to size it",
            UserWarning,
            stacklevel=3,
        )


def plan_num_blocks(
    *,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float | None,
    device: jax.Device,
    weights_bytes: int = 0,
    reserved_bytes: int = 0,
) -> int:
    """Pool size in blocks (the null block included), checked to hold one max_model_len request.

    In order: `num_kv_blocks`; `kv_cache_memory_bytes`; on GPU `gpu_memory_utilization` of
    device memory less what is in use and `reserved_bytes` (the scratch of the largest step,
    profiled); on CPU CPU_KV_SHARE_OF_WEIGHTS of `weights_bytes`, at most CPU_MAX_KV_BYTES
    and at most what max_num_seqs full-length requests use, but at least one max_model_len
    request.
    """
    blocks_per_request = -(-max_model_len // block_size)
    stats = device.memory_stats() if device.platform != "cpu" else None
    if device.platform == "cpu" and gpu_memory_utilization is not None:
        warn_gpu_memory_utilization_on_cpu()
    if num_kv_blocks is not None:
        num_blocks, source = num_kv_blocks, "num_kv_blocks"
    elif kv_cache_memory_bytes is not None:
        num_blocks, source = kv_cache_memory_bytes // bytes_per_block, "kv_cache_memory_bytes"
    elif stats and "bytes_limit" in stats:
        utilization = gpu_memory_utilization or GPU_MEMORY_UTILIZATION
        free = int(stats["bytes_limit"] * utilization) - stats.get("bytes_in_use", 0) - reserved_bytes
        num_blocks, source = max(free, 0) // bytes_per_block, f"gpu_memory_utilization={utilization}"
    else:
        num_blocks, source = _cpu_default(bytes_per_block, blocks_per_request, max_num_seqs, weights_bytes)
    if num_blocks - 1 < blocks_per_request:
        largest = (num_blocks - 1) * block_size
        raise ValueError(
            f"the KV pool from {source} has {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * bytes_per_block / 2**20:.1f} MiB), which cannot hold one request of "
            f"max_model_len={max_model_len} ({blocks_per_request} blocks + the null block); "
            f"lower max_model_len to at most {max(largest, 0)} or give the pool more memory"
        )
    tokens = (num_blocks - 1) * block_size
    typical = min(TYPICAL_REQUEST_TOKENS, max_model_len)
    logger.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB, from %s; it holds %d requests of "
        "max_model_len=%d at once, or about %d of %d tokens (max_num_seqs=%d)",
        num_blocks, block_size, tokens, num_blocks * bytes_per_block / 2**20, source,
        (num_blocks - 1) // blocks_per_request, max_model_len, tokens // typical, typical, max_num_seqs,
    )
    return num_blocks


def _cpu_default(bytes_per_block: int, blocks_per_request: int, max_num_seqs: int, weights_bytes: int) -> tuple[int, str]:
    """The CPU rule: (blocks, why)."""
    budget = min(int(weights_bytes * CPU_KV_SHARE_OF_WEIGHTS), CPU_MAX_KV_BYTES)
    from_budget = budget // bytes_per_block
    all_full_length = max_num_seqs * blocks_per_request + 1
    one_request = blocks_per_request + 1
    num_blocks = max(min(from_budget, all_full_length), one_request)
    if num_blocks == one_request and from_budget < one_request:
        why = "the CPU default raised to one max_model_len request"
    elif num_blocks == all_full_length and from_budget > all_full_length:
        why = f"the CPU default capped at max_num_seqs={max_num_seqs} full-length requests"
    else:
        why = (f"the CPU default: {CPU_KV_SHARE_OF_WEIGHTS:g} x the weights' {weights_bytes / 2**20:.0f} MiB, "
               f"at most {CPU_MAX_KV_BYTES >> 30} GiB")
    return num_blocks, why + " (set kv_cache_memory_bytes or num_kv_blocks to choose)"
