"""What identifies a cached KV block (vLLM V1's chained block hashes) and who may read the cache.

A full block's hash covers its own token ids and, through the previous block's hash, every
token before it: equal hashes mean equal prefixes, so equal KV. Two different prefixes with one
hash would let a request read another's KV (vLLM's CVE-2025-25183), so the default hash is
sha256 over a stable serialisation of (parent hash, token ids), as vLLM's. Python's 64-bit
`hash` of an int tuple ("builtin", the explicit fast option) collides on inputs anyone can build:
hash(-1) == hash(-2), hash(2**61 - 1) == hash(0), and its tuple mixing is not made to resist a
search; it is for one tenant's engine that wants the host time back (BENCHMARKS.md, "Prefix-cache
block hash").

Every chain starts from a root drawn at random per engine start, so a prompt cannot be built
offline against a running engine's hashes; with PYTHONHASHSEED set the root derives from it,
and engines with the same seed hash alike (vLLM's rule). A request under a LoRA adapter starts its
chain from the root hashed with the adapter's id: the same tokens under another adapter (or none)
have other KV, so their blocks never match (vLLM keys blocks by adapter too).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from typing import Any

from cbjax.core.request import Request

BlockHash = bytes | int  # bytes: sha256; int: builtin


def sha256_block_hash(parent_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
    return hashlib.sha256(pickle.dumps((parent_hash, token_ids), protocol=pickle.HIGHEST_PROTOCOL)).digest()


def builtin_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


# vLLM's option name and its default; "builtin" is the name vLLM gave Python's hash before it dropped it.
HASH_ALGOS: dict[str, Callable[[Any, tuple[int, ...]], BlockHash]] = {
    "sha256": sha256_block_hash, "builtin": builtin_block_hash,
}


def check_hash_algo(algo: str) -> None:
    if algo not in HASH_ALGOS:
        raise ValueError(
            f"prefix_caching_hash_algo={algo!r} is not one of {', '.join(map(repr, HASH_ALGOS))}; "
            "use 'sha256' (collision-resistant, the default) or 'builtin' (Python's hash, one tenant only)"
        )


class BlockHasher:
    """One engine's block hashes: its algorithm and the root every chain starts from."""

    def __init__(self, algo: str = "sha256"):
        check_hash_algo(algo)
        self.algo = algo
        self.hash_block = HASH_ALGOS[algo]
        seed = os.environ.get("PYTHONHASHSEED")
        root = os.urandom(32) if seed is None else hashlib.sha256(seed.encode()).digest()
        self.root: BlockHash = root if algo == "sha256" else int.from_bytes(root[:8], "little")

    def extend(self, request: Request, block_size: int) -> list[BlockHash]:
        """`request.block_hashes` grown to cover every full block of its tokens (incremental)."""
        hashes, tokens, hash_block = request.block_hashes, request.all_token_ids, self.hash_block
        for index in range(len(hashes), len(tokens) // block_size):
            parent = hashes[-1] if hashes else self.chain_root(request)
            hashes.append(hash_block(parent, tuple(tokens[index * block_size : (index + 1) * block_size])))
        return hashes


    def chain_root(self, request: Request) -> BlockHash:
        """Where `request`'s chain starts: the root, or for an adapter's request the root hashed with
        its id (a key holding a str, which no block's token ids equal)."""
        lora = request.lora_request
        return self.root if lora is None else self.hash_block(self.root, ("lora", lora.lora_int_id))


def computes_whole_prompt(params: Any) -> bool:
    """True for a request that must compute its prompt itself, so it reads no cached blocks.

    Penalty counts and prompt logprobs are built inside the step from the prompt tokens it
    computes; such a request still fills the cache for others, and with n > 1 it is not forked.
    """
    return params.has_penalties or params.prompt_logprobs is not None
