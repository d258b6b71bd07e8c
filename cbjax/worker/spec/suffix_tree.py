"""A depth-bounded suffix trie with occurrence counts: the data structure behind suffix decoding."""

from dataclasses import dataclass, field

import numpy as np


class TrieNode:
    """A substring that occurred more than once (or did, before an eviction): `count` occurrences.

    `children` holds its one-longer substrings that are nodes too; `tails` its one-longer substrings
    that occurred once, as token -> (seq_id, next_pos): the occurrence ends at seq[next_pos - 1], and
    everything longer below it occurred once too, so the sequence itself spells it out (no nodes)."""

    __slots__ = ("count", "depth", "children", "tails")

    def __init__(self, depth: int, count: int):
        self.count = count
        self.depth = depth
        self.children: dict[int, "TrieNode"] = {}
        self.tails: dict[int, tuple[object, int]] = {}


@dataclass
class Draft:
    """A greedy continuation: tokens, score = sum of their estimated acceptance probabilities."""

    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTrie:
    """Every substring of at most `max_depth` tokens of a set of sequences, with occurrence counts.

    Substrings that occurred once are not stored (see TrieNode.tails), so memory grows with the
    sequences plus their repeated substrings rather than with max_depth * tokens, as arctic-inference's
    path-compressed tree. Appending a token lengthens the open suffixes (shorter than max_depth, ending
    at the previous token, seen elsewhere too) by one: O(max_depth) per token at most, whatever the
    sequence's length, and O(1) where the text does not repeat itself. `remove`
    takes a closed sequence's counts back out (eviction from the global cache)."""

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(
                f"suffix_decoding_max_tree_depth={max_depth} must be >= 2 (one matched token plus one "
                f"proposed); raise it in speculative_config")
        self.max_depth = max_depth
        self.root = TrieNode(depth=0, count=0)
        self.sequences: dict[object, list[int]] = {}
        # seq_id -> {start: node of seq[start:]} for its open suffixes that occurred elsewhere too; the
        # others occurred only there, and so will their extensions: they need no work per token
        self._open: dict[object, dict[int, TrieNode]] = {}

    def extend(self, seq_id, token_ids) -> None:
        """Appends token_ids [n] to sequence seq_id (a new one if unseen)."""
        seq = self.sequences.setdefault(seq_id, [])
        open_suffixes = self._open.setdefault(seq_id, {})
        for token in np.asarray(token_ids, dtype=np.int64).tolist():
            seq.append(token)
            self.root.count += 1
            grown = {}
            for start, node in [*open_suffixes.items(), (len(seq) - 1, self.root)]:
                child = self._add_occurrence(node, token, seq_id, len(seq))
                if child is not None and child.depth < self.max_depth:
                    grown[start] = child
            open_suffixes = self._open[seq_id] = grown

    def _add_occurrence(self, node: TrieNode, token: int, seq_id, next_pos: int) -> TrieNode | None:
        """Counts one more occurrence of node's substring + token; its node, None if it is the first."""
        child = node.children.get(token)
        if child is not None:
            child.count += 1
            return child
        if token not in node.tails:
            node.tails[token] = (seq_id, next_pos)
            return None
        # the second occurrence: the substring becomes a node; the first one's next token a tail
        first_seq_id, first_next = node.tails.pop(token)
        child = node.children[token] = TrieNode(node.depth + 1, count=2)
        first_seq = self.sequences[first_seq_id]
        if child.depth < self.max_depth:
            if first_next < len(first_seq):
                child.tails[first_seq[first_next]] = (first_seq_id, first_next + 1)
            elif first_seq_id in self._open:  # it ends a growing sequence: now an open suffix seen twice
                self._open[first_seq_id][first_next - child.depth] = child
        return child

    def close(self, seq_id) -> None:
        """Stops seq_id from growing; its tokens stay (tails point into them) until remove."""
        self._open.pop(seq_id, None)

    def remove(self, seq_id) -> None:
        """Takes back the counts a closed sequence added and forgets it; drops substrings left at zero."""
        seq = self.sequences.pop(seq_id)
        for start in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for token in seq[start:start + self.max_depth]:
                child = node.children.get(token)
                if child is None:
                    del node.tails[token]  # occurred once: here
                    break
                child.count -= 1
                if child.count == 0:
                    del node.children[token]  # its whole subtree came from this occurrence alone
                    break
                node = child

    def speculate(self, context: list[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """Best greedy draft after the suffixes of `context`, as arctic-inference's SuffixTree.

        For each suffix length m that occurs (1 up to max_depth - 1), follow the most frequent child
        while the cumulative probability prod(child.count / parent.count) stays >= min_token_prob,
        for at most min(max_spec_tokens, floor(max_spec_factor * m), max_depth - m) tokens; keep the
        draft with the highest score (expected number of accepted tokens), the longer match on ties."""
        best = Draft()
        for match_len in range(1, min(len(context), self.max_depth - 1) + 1):
            limit = min(max_spec_tokens, int(max_spec_factor * match_len + 1e-6), self.max_depth - match_len)
            draft = self._follow(context[len(context) - match_len:], limit, min_token_prob)
            if draft is None:
                break  # a longer suffix contains this one, so it cannot occur either
            if draft.token_ids and draft.score >= best.score:
                best = draft
        return best

    def _follow(self, pattern: list[int], limit: int, min_token_prob: float) -> Draft | None:
        """Matches pattern, then drafts up to limit tokens greedily; None when pattern never occurred."""
        node, tail, matched = self.root, None, 0
        while matched < len(pattern) and tail is None:
            token = pattern[matched]
            if token in node.children:
                node = node.children[token]
            elif token in node.tails:
                tail = node.tails[token]
            else:
                return None
            matched += 1
        draft, prob = Draft(match_len=len(pattern)), 1.0
        while tail is None and len(draft.token_ids) < limit and (node.children or node.tails):
            # most frequent child (a tail counts 1); the smallest token id breaks ties: deterministic
            counts = {**{t: 1 for t in node.tails}, **{t: c.count for t, c in node.children.items()}}
            token = max(counts, key=lambda t: (counts[t], -t))
            prob *= counts[token] / node.count
            if prob < min_token_prob:
                return draft
            draft.token_ids.append(token)
            draft.score += prob
            if token in node.children:
                node = node.children[token]
            else:
                tail = node.tails[token]
        if tail is not None:
            # one occurrence: the rest of the pattern must follow it; each further token has prob 1
            seq_id, next_pos = tail
            seq = self.sequences[seq_id]
            rest = len(pattern) - matched
            if seq[next_pos:next_pos + rest] != pattern[matched:]:
                return None
            for token in seq[next_pos + rest:next_pos + rest + limit - len(draft.token_ids)]:
                draft.token_ids.append(token)
                draft.score += prob
        return draft
