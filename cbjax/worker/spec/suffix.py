"""Suffix-decoding proposer (Snowflake's SuffixDecoding, vLLM's method "suffix"): drafts from a trie of
the request's own prompt+output and a global trie of earlier finished requests' outputs."""

import numpy as np

from cbjax.worker.spec.suffix_tree import Draft, SuffixTrie


class SuffixProposer:
    """Per-request tries fed incrementally (start_request / extend / finish_request), one global trie
    over the outputs of the last `max_cached_requests` finished requests (oldest evicted first).

    A draft is taken from both tries (SuffixTrie.speculate); the one with the higher score, i.e. the
    larger expected number of accepted tokens, wins, the request's own trie on ties (arctic-inference's
    rule). Option names and defaults are vLLM's speculative_config ones."""

    def __init__(self, num_speculative_tokens: int | None = None, suffix_decoding_max_tree_depth: int = 24,
                 suffix_decoding_max_cached_requests: int = 10000,
                 suffix_decoding_max_spec_factor: float = 1.0,
                 suffix_decoding_min_token_prob: float = 0.1):
        # vLLM: num_speculative_tokens defaults to the tree depth for suffix decoding
        k = suffix_decoding_max_tree_depth if num_speculative_tokens is None else num_speculative_tokens
        if k < 1:
            raise ValueError(
                f"num_speculative_tokens={k} must be >= 1 for suffix speculation; set it in "
                f"speculative_config")
        if suffix_decoding_max_cached_requests < 0:
            raise ValueError(
                f"suffix_decoding_max_cached_requests={suffix_decoding_max_cached_requests} must be >= 0 "
                f"(0 turns the global cache off)")
        if suffix_decoding_max_spec_factor <= 0:
            raise ValueError(
                f"suffix_decoding_max_spec_factor={suffix_decoding_max_spec_factor} must be > 0; it caps "
                f"the draft at factor * matched length")
        if not 0.0 <= suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(
                f"suffix_decoding_min_token_prob={suffix_decoding_min_token_prob} must be in [0, 1]")
        self.k = k
        self.max_depth = suffix_decoding_max_tree_depth
        self.max_cached_requests = suffix_decoding_max_cached_requests
        self.max_spec_factor = suffix_decoding_max_spec_factor
        self.min_token_prob = suffix_decoding_min_token_prob
        self.global_trie = SuffixTrie(self.max_depth)
        self.cached_request_ids: dict[object, None] = {}  # insertion order: oldest first
        self._request_tries: dict[object, SuffixTrie] = {}
        self._prompt_lens: dict[object, int] = {}  # where the output starts in the request's sequence

    def start_request(self, request_id, prompt_token_ids) -> None:
        """Builds the request's trie over its prompt [num_prompt_tokens]."""
        if request_id in self._request_tries:
            raise ValueError(f"request {request_id!r} already started; finish_request it first")
        self._request_tries[request_id] = SuffixTrie(self.max_depth)
        self._request_tries[request_id].extend(request_id, prompt_token_ids)
        self._prompt_lens[request_id] = len(prompt_token_ids)

    def extend(self, request_id, new_token_ids) -> None:
        """Appends the request's newly generated tokens [n]; O(max_depth) per token."""
        self._request_tries[request_id].extend(request_id, new_token_ids)

    def finish_request(self, request_id) -> None:
        """Drops the request's trie and moves its output into the global cache."""
        request_trie = self._request_tries.pop(request_id)
        output = request_trie.sequences[request_id][self._prompt_lens.pop(request_id):]
        if self.max_cached_requests == 0 or not output:
            return
        if request_id in self.cached_request_ids:  # a reused id: its older output goes first
            del self.cached_request_ids[request_id]
            self.global_trie.remove(request_id)
        self.global_trie.extend(request_id, output)
        self.global_trie.close(request_id)
        self.cached_request_ids[request_id] = None
        while len(self.cached_request_ids) > self.max_cached_requests:
            oldest = next(iter(self.cached_request_ids))
            del self.cached_request_ids[oldest]
            self.global_trie.remove(oldest)

    def propose_request(self, request_id) -> np.ndarray:
        """draft: [<= k] int32 for a started request; empty when neither trie matches."""
        request_trie = self._request_tries[request_id]
        return self._best_draft(request_trie, request_trie.sequences[request_id][-self.max_depth:])

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """The stateless Proposer form: token_ids [num_tokens] -> draft [<= k] int32, building the
        request trie from scratch (O(num_tokens * max_depth); the engine uses propose_request)."""
        request_trie = SuffixTrie(self.max_depth)
        request_trie.extend(None, token_ids)
        context = np.asarray(token_ids, dtype=np.int64)[-self.max_depth:].tolist()
        return self._best_draft(request_trie, context)

    def _best_draft(self, request_trie: SuffixTrie, context: list[int]) -> np.ndarray:
        args = (context, self.k, self.max_spec_factor, self.min_token_prob)
        own: Draft = request_trie.speculate(*args)
        cached: Draft = self.global_trie.speculate(*args)
        best = cached if cached.score > own.score else own
        return np.asarray(best.token_ids, dtype=np.int32)
