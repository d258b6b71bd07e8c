"""A depth-bounded suffix trie with occurrence counts: the data structure behind suffix decoding."""

from dataclasses import dataclass, field

import numpy as np


class TrieNode:
    """One substring: `count` = how often it occurred, `children` = token -> the substring one longer."""

    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, "TrieNode"] = {}


@dataclass
class Draft:
    """A greedy continuation: tokens, score = sum of their estimated acceptance probabilities."""

    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTrie:
    """Every substring of at most `max_depth` tokens of a set of sequences, with occurrence counts.

    A sequence is appended with `extend(seq_id, tokens)`: each new token lengthens every open suffix
    (those shorter than max_depth ending at the previous token) by one, so appending costs
    O(max_depth) per token whatever the sequence's length. `remove` takes a sequence's counts back out
    (eviction from the global cache)."""

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(
                f"suffix_decoding_max_tree_depth={max_depth} must be >= 2 (one matched token plus one "
                f"proposed); raise it in speculative_config")
        self.max_depth = max_depth
        self.root = TrieNode()
        # seq_id -> nodes of the suffixes ending at that sequence's last token, shortest first
        self._open: dict[object, list[TrieNode]] = {}

    def extend(self, seq_id, token_ids) -> None:
        """Appends token_ids [n] to sequence seq_id (a new one if unseen)."""
        open_nodes = self._open.get(seq_id, [])
        for token in np.asarray(token_ids, dtype=np.int64).tolist():
            grown = []
            for node in [self.root] + open_nodes:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = TrieNode()
                child.count += 1
                grown.append(child)
            self.root.count += 1
            open_nodes = grown[:self.max_depth - 1]  # a suffix of max_depth tokens cannot grow further
        self._open[seq_id] = open_nodes

    def close(self, seq_id) -> None:
        """Forgets seq_id's open suffixes: it will not be extended again."""
        self._open.pop(seq_id, None)

    def remove(self, token_ids) -> None:
        """Takes back the counts a closed sequence token_ids [n] added; drops substrings left at zero."""
        tokens = np.asarray(token_ids, dtype=np.int64).tolist()
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]  # its whole subtree came from this occurrence alone
                    break
                node = child

    def find(self, pattern: list[int]) -> TrieNode | None:
        """The node of substring `pattern`, or None when it never occurred."""
        node = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def speculate(self, context: list[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """Best greedy draft after the suffixes of `context`, as arctic-inference's SuffixTree.

        For each suffix length m that occurs (1 up to max_depth - 1), follow the most frequent child
        while the cumulative probability prod(child.count / parent.count) stays >= min_token_prob,
        for at most min(max_spec_tokens, floor(max_spec_factor * m), max_depth - m) tokens; keep the
        draft with the highest score (expected number of accepted tokens), the longer match on ties."""
        best = Draft()
        for match_len in range(1, min(len(context), self.max_depth - 1) + 1):
            node = self.find(context[len(context) - match_len:])
            if node is None:
                break  # a longer suffix contains this one, so it cannot occur either
            limit = min(max_spec_tokens, int(max_spec_factor * match_len + 1e-6),
                        self.max_depth - match_len)
            draft = Draft(match_len=match_len)
            prob = 1.0
            while len(draft.token_ids) < limit and node.children:
                # most frequent child; the smallest token id breaks ties so drafts are deterministic
                token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
                prob *= child.count / node.count
                if prob < min_token_prob:
                    break
                draft.token_ids.append(token)
                draft.score += prob
                node = child
            if draft.token_ids and draft.score >= best.score:
                best = draft
        return best
