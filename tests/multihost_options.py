"""The engine options and prompts both processes of the 2-process test share (test_multihost.py)."""

ENGINE_OPTIONS = dict(
    tensor_parallel_size=4, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, block_size=8,
    kv_cache_memory_bytes=40960,  # 20 blocks per device: the four requests preempt each other
)
PROMPT_LENGTHS = (60, 45, 37, 5)  # chunked: longer than max_num_batched_tokens
MAX_TOKENS = 8


def prompts() -> list[list[int]]:
    return [[3 + (7 * i + 13 * n) % 290 for i in range(n)] for n in PROMPT_LENGTHS]


def worker_flags() -> list[str]:
    """ENGINE_OPTIONS as `cbjax worker` flags."""
    return [arg for name, value in ENGINE_OPTIONS.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
