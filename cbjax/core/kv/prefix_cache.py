"""What identifies a cached KV block (vLLM V1's chained block hashes) and who may read the cache.

A full block's hash covers its own token ids and, through the previous block's hash, every
token before it: equal hashes mean equal prefixes, so equal KV. Python's tuple hash is 64-bit
and deterministic for ints; two different prefixes colliding is a 2**-64 event per pair, the
risk vLLM's "builtin" hash option also takes.
"""

from __future__ import annotations

from typing import Any

from cbjax.core.request import Request

NO_PARENT_HASH = 0  # the "previous block hash" of a request's first block


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def extend_block_hashes(request: Request, block_size: int) -> list[int]:
    """`request.block_hashes` grown to cover every full block of its tokens (incremental)."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for index in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else NO_PARENT_HASH
        hashes.append(hash_block_tokens(parent, tuple(tokens[index * block_size : (index + 1) * block_size])))
    return hashes


def computes_whole_prompt(params: Any) -> bool:
    """True for a request that must compute its prompt itself, so it reads no cached blocks.

    Penalty counts and prompt logprobs are built inside the step from the prompt tokens it
    computes; such a request still fills the cache for others, and with n > 1 it is not forked.
    """
    return params.has_penalties or params.prompt_logprobs is not None
