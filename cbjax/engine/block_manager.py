"""KV-cache block allocation: a free list and per-block reference counts over a fixed pool."""

from collections import deque
from collections.abc import Iterable

from cbjax.engine.request import Request

NULL_BLOCK_ID = 0  # padded block-table entries point here; never handed to a request


class BlockManager:
    """Hands out blocks 1..num_blocks-1; a request's blocks grow step by step.

    Reference counts are kept per block so that prefix caching can later share
    a block between requests; today every owned block has exactly one owner.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks is {num_blocks}; block {NULL_BLOCK_ID} is the null block, "
                "so at least 2 are needed; give the KV cache more memory or blocks"
            )
        if block_size < 1:
            raise ValueError(f"block_size is {block_size}; it must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` lacks to hold its computed tokens plus `num_new_tokens` more."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, self.blocks_needed(num_tokens) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(request, num_new_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow `request.block_ids` to hold num_computed_tokens + num_new_tokens tokens."""
        num_missing = self.num_missing_blocks(request, num_new_tokens)
        if num_missing > self.num_free_blocks:
            raise RuntimeError(
                f"request {request.request_id} needs {num_missing} more blocks; "
                f"{self.num_free_blocks} are free; call can_allocate first"
            )
        for _ in range(num_missing):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)

    def free(self, request: Request) -> None:
        """Release every block of `request`; a block returns to the free list at refcount 0."""
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        request.block_ids.clear()

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """For tests: every block but the null one is free or owned, never both, never twice."""
        owners: dict[int, str] = {}
        for request in requests:
            for block_id in request.block_ids:
                assert block_id != NULL_BLOCK_ID, f"request {request.request_id} owns the null block"
                assert block_id not in owners, (
                    f"block {block_id} owned by {owners[block_id]} and {request.request_id}"
                )
                owners[block_id] = request.request_id
                assert self.ref_counts[block_id] == 1, (
                    f"block {block_id} has refcount {self.ref_counts[block_id]}, one owner"
                )
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is twice in the free list"
        assert NULL_BLOCK_ID not in free, "the null block is in the free list"
        assert not free & owners.keys(), f"blocks both free and owned: {free & owners.keys()}"
        lost = set(range(1, self.num_blocks)) - free - owners.keys()
        assert not lost, f"blocks neither free nor owned: {sorted(lost)}"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block has a nonzero refcount"
