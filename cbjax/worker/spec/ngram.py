"""Prompt-lookup (n-gram) proposer, as vLLM's ngram_proposer: the longest recent suffix seen earlier."""

import numpy as np


class NgramProposer:
    """Finds the longest suffix (prompt_lookup_max down to prompt_lookup_min tokens) that occurred
    earlier in prompt+output and proposes the up-to-k tokens that followed its latest earlier match."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"ngram speculation needs 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                f"prompt_lookup_max ({prompt_lookup_max}); set them in speculative_config")
        if num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens={num_speculative_tokens} must be >= 1 for ngram speculation")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """token_ids: [num_tokens] int -> draft: [<= k] int32; empty when no suffix recurs."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        total = tokens.shape[0]
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows[i] = tokens[i:i+n] for every start that is not the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                start = hits[-1] + n  # latest earlier occurrence: the most recent context
                return tokens[start:start + self.k].copy()
        return np.zeros(0, dtype=np.int32)
