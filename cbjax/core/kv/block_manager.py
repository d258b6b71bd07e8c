"""KV-cache blocks: reference counts, an LRU free queue and the prefix cache over a fixed pool.

With prefix caching (vLLM V1's design), every full block whose KV is written is registered
under its chained hash (prefix_cache.py). A freed block keeps its hash and waits in the free
queue; it is evicted only when the allocator hands it out again. The queue is least recently
freed first, blocks without a hash before any cached one, and a request's blocks are freed
tail first, so its prefix outlives its tail. A block with a nonzero reference count is never
in the queue, so a block in use is never evicted or overwritten.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from cbjax.core.kv.prefix_cache import BlockHash, BlockHasher, computes_whole_prompt
from cbjax.core.request import Request

NULL_BLOCK_ID = 0  # padded block-table entries point here; never handed to a request


class BlockManager:
    """Hands out blocks 1..num_blocks-1; a request's blocks grow step by step.

    A block is shared (reference count > 1) when several requests found it in the prefix cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, hash_algo: str = "sha256"):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks is {num_blocks}; block {NULL_BLOCK_ID} is the null block, "
                "so at least 2 are needed; give the KV cache more memory or blocks"
            )
        if block_size < 1:
            raise ValueError(f"block_size is {block_size}; it must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hasher = BlockHasher(hash_algo)
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # evicted from the front
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks  # the hash a block is cached under
        self.cached_blocks: dict[BlockHash, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # tokens of admitted requests that looked up the cache (vLLM counts so)
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted when handed out)."""
        return len(self.free_queue)

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest chain of cached blocks that starts `request`'s tokens, leaving its last token to compute."""
        if not self.enable_caching or computes_whole_prompt(request.sampling_params):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is computed for its logits
        computed = []
        for block_hash in self.hasher.extend(request, self.block_size)[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            computed.append(block_id)
        return computed

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks of `request` that its computed tokens have filled (their KV is written)."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = request.num_registered_blocks
        if num_full <= start:
            return
        hashes = self.hasher.extend(request, self.block_size)
        for index in range(start, num_full):
            block_id, block_hash = request.block_ids[index], hashes[index]
            # Equal content computed twice at once: the first block registered stays the cached one.
            if block_hash not in self.cached_blocks:
                self.cached_blocks[block_hash] = block_id
                self.block_hashes[block_id] = block_hash
        request.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); False, doing nothing, while blocks are in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached_blocks.clear()
        self.block_hashes = [None] * self.num_blocks
        return True

    # ---- allocation ---------------------------------------------------------------

    def num_missing_blocks(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """Blocks `request` lacks to hold its computed (or cached) tokens plus `num_new_tokens` more."""
        num_owned = len(request.block_ids) + len(computed_blocks)
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(num_tokens) - num_owned)

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        # A cached block nobody holds leaves the free queue when this request takes it.
        num_reused_free = sum(self.ref_counts[block_id] == 0 for block_id in computed_blocks) if computed_blocks else 0
        return self.num_missing_blocks(request, num_new_tokens, computed_blocks) <= self.num_free_blocks - num_reused_free

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> None:
        """Grow `request.block_ids` to hold num_computed_tokens + num_new_tokens tokens.

        A waiting request being admitted passes its `computed_blocks` (get_computed_blocks): it
        takes them first and starts at the tokens they hold, and the lookup is counted.
        """
        if not self.can_allocate(request, num_new_tokens, computed_blocks or ()):
            raise RuntimeError(
                f"request {request.request_id} needs "
                f"{self.num_missing_blocks(request, num_new_tokens, computed_blocks or ())} more blocks; "
                f"{self.num_free_blocks} are free; call can_allocate first"
            )
        if computed_blocks is not None:
            self._take_computed_blocks(request, computed_blocks)
        for _ in range(self.num_missing_blocks(request, num_new_tokens)):
            self._append_free_block(request)

    def append_block(self, request: Request) -> bool:
        """Give `request` one more block if one is free; False (nothing done) if none is. The
        scheduler's check-and-allocate for a decode that starts a block (a few requests every step),
        in one call instead of can_allocate and allocate."""
        if not self.free_queue:
            return False
        self._append_free_block(request)
        return True

    def _append_free_block(self, request: Request) -> None:
        """Give `request` the block at the head of the free queue (evicting what it cached); the caller
        checked that one is free."""
        block_id, _ = self.free_queue.popitem(last=False)
        self._evict(block_id)
        self.ref_counts[block_id] = 1
        request.block_ids.append(block_id)

    def _take_computed_blocks(self, request: Request, computed_blocks: list[int]) -> None:
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
        request.block_ids.extend(computed_blocks)
        num_cached_tokens = len(computed_blocks) * self.block_size
        request.num_computed_tokens += num_cached_tokens
        request.num_registered_blocks = len(computed_blocks)
        if self.enable_caching and not computes_whole_prompt(request.sampling_params):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.block_hashes[block_id] = None

    def free(self, request: Request) -> None:
        """Release every block of `request`, tail first; a block joins the free queue at refcount 0."""
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                if self.block_hashes[block_id] is None:  # nothing to keep: hand it out before any cached block
                    self.free_queue.move_to_end(block_id, last=False)
        request.block_ids.clear()
        request.num_registered_blocks = 0

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """For tests: every block but the null one is free or held, refcount = holders, the cache is consistent."""
        holders: dict[int, list[str]] = {}
        for request in requests:
            assert len(set(request.block_ids)) == len(request.block_ids), f"request {request.request_id} holds a block twice"
            for block_id in request.block_ids:
                assert block_id != NULL_BLOCK_ID, f"request {request.request_id} owns the null block"
                holders.setdefault(block_id, []).append(request.request_id)
        for block_id, names in holders.items():
            if len(names) > 1:  # only a cached block may be shared
                assert self.block_hashes[block_id] is not None, f"block {block_id} owned by {' and '.join(names)}"
            assert self.ref_counts[block_id] == len(names), (
                f"block {block_id} has refcount {self.ref_counts[block_id]}, held by {names}"
            )
        free = set(self.free_queue)
        assert NULL_BLOCK_ID not in free, "the null block is in the free list"
        assert not free & holders.keys(), f"blocks both free and owned: {free & holders.keys()}"
        lost = set(range(1, self.num_blocks)) - free - holders.keys()
        assert not lost, f"blocks neither free nor owned: {sorted(lost)}"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block has a nonzero refcount"
        for block_hash, block_id in self.cached_blocks.items():
            assert self.block_hashes[block_id] == block_hash, f"block {block_id} is cached under a stale hash"
        assert sum(h is not None for h in self.block_hashes) == len(self.cached_blocks), "a block hash is not in the cache"
