"""The engine's proposer: drafts for a request from its tokens so far, by speculative_config's method."""

from __future__ import annotations

import numpy as np

from cbjax.core.request import Request
from cbjax.core.spec.config import SpeculativeConfig
from cbjax.worker.spec.ngram import NgramProposer
from cbjax.worker.spec.suffix import SuffixProposer


class Drafter:
    """n-gram proposes from the whole token list each time (a pass over it, as vLLM's); suffix feeds its
    per-request trie only the tokens that arrived since the request's last draft."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        if config.method == "ngram":
            self.ngram = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
            self.suffix = None
        else:
            self.ngram = None
            self.suffix = SuffixProposer(self.k, config.suffix_decoding_max_tree_depth,
                                         config.suffix_decoding_max_cached_requests,
                                         config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
        self._num_fed: dict[str, int] = {}  # suffix: the tokens of each request its trie holds

    def draft(self, requests: list[Request]) -> list[list[int]]:
        """Up to k tokens to follow each request's all_token_ids (empty: none recur)."""
        return [self._draft(request) for request in requests]

    def _draft(self, request: Request) -> list[int]:
        if self.suffix is None:
            return self.ngram.propose(np.asarray(request.all_token_ids, np.int32)).tolist()
        self._feed(request)
        return self.suffix.propose_request(request.request_id).tolist()

    def _feed(self, request: Request) -> None:
        """Give the request's trie the tokens that arrived since it was last fed."""
        request_id, tokens = request.request_id, request.all_token_ids
        fed = self._num_fed.get(request_id)
        if fed is None:
            self.suffix.start_request(request_id, np.asarray(request.prompt_token_ids, np.int32))
            fed = request.num_prompt_tokens
        if fed < len(tokens):
            self.suffix.extend(request_id, np.asarray(tokens[fed:], np.int32))
        self._num_fed[request_id] = len(tokens)

    def finish(self, request: Request) -> None:
        """The request is done: suffix decoding keeps its output for later requests' drafts."""
        if self.suffix is not None:
            self._feed(request)
            del self._num_fed[request.request_id]
            self.suffix.finish_request(request.request_id)
