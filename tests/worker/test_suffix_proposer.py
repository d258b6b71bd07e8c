from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.worker.spec.suffix import SuffixProposer
from cbjax.worker.spec.suffix_tree import SuffixTrie


def trie_counts(trie):
    # substring (tuple) -> count, read off the trie; a tail spells out once-seen substrings
    out, stack = {}, [((), trie.root)]
    while stack:
        prefix, node = stack.pop()
        for token, child in node.children.items():
            out[prefix + (token,)] = child.count
            stack.append((prefix + (token,), child))
        for token, (seq_id, next_pos) in node.tails.items():
            substring = prefix + (token,)
            rest = trie.sequences[seq_id][next_pos:next_pos + trie.max_depth - len(substring)]
            for end in range(len(substring), len(substring) + len(rest) + 1):
                out[(substring + tuple(rest))[:end]] = 1
    return out


def substring_counts(sequences, max_depth):
    # brute force: every occurrence of every substring of at most max_depth tokens
    counts = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + max_depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return dict(counts)


def proposer_with_cache(outputs, **options):
    # a proposer whose global cache holds `outputs` (finished requests with empty prompts)
    p = SuffixProposer(**options)
    for i, output in enumerate(outputs):
        p.start_request(f"done{i}", [])
        p.extend(f"done{i}", output)
        p.finish_request(f"done{i}")
    return p


def draft_for(p, prompt):
    p.start_request("new", prompt)
    draft = p.propose_request("new").tolist()
    p.finish_request("new")
    return draft


def test_hand_worked_trie_counts():
    trie = SuffixTrie(max_depth=3)
    trie.extend("a", [1, 2, 1, 2, 3])
    assert trie_counts(trie) == {
        (1,): 2, (2,): 2, (3,): 1, (1, 2): 2, (2, 1): 1, (2, 3): 1,
        (1, 2, 1): 1, (2, 1, 2): 1, (1, 2, 3): 1}
    trie.extend("b", [2, 3])
    counts = trie_counts(trie)
    assert (counts[(2,)], counts[(3,)], counts[(2, 3)], trie.root.count) == (3, 2, 2, 7)


def test_repeated_pattern_proposes_what_followed_before():
    p = SuffixProposer(num_speculative_tokens=4, suffix_decoding_max_tree_depth=8)
    # "5 6 7" occurred before followed by 8 9 5; a 3-token match allows 3 tokens (factor 1)
    assert draft_for(p, [5, 6, 7, 8, 9, 5, 6, 7]) == [8, 9, 5]
    assert p.propose(np.array([5, 6, 7, 8, 9, 5, 6, 7])).tolist() == [8, 9, 5]


def test_frequency_decides_between_continuations():
    p = proposer_with_cache([[1, 2, 3], [1, 2, 3], [1, 2, 4]])
    assert draft_for(p, [9, 1, 2]) == [3]
    p = proposer_with_cache([[1, 2, 3], [1, 2, 4], [1, 2, 4]])
    assert draft_for(p, [9, 1, 2]) == [4]


def test_min_token_prob_cuts_on_cumulative_probability():
    # after "1 2": 3 with prob 2/2, then 4 or 5 with 1/2 each -> cumulative 1.0, 0.5
    outputs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    options = dict(suffix_decoding_max_spec_factor=4.0)
    assert draft_for(proposer_with_cache(outputs, suffix_decoding_min_token_prob=0.5, **options),
                     [1, 2]) == [3, 4]
    assert draft_for(proposer_with_cache(outputs, suffix_decoding_min_token_prob=0.51, **options),
                     [1, 2]) == [3]
    # 3 with prob 2/4, then 4 with 1/2: cumulative 0.25 is below 0.3 although each step is 0.5
    outputs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 8], [1, 2, 9]]
    assert draft_for(proposer_with_cache(outputs, suffix_decoding_min_token_prob=0.3, **options),
                     [1, 2]) == [3]


@pytest.mark.parametrize("factor, expected", [(1.0, [4, 5]), (1.5, [4, 5, 6]), (2.0, [4, 5, 6, 7])])
def test_max_spec_factor_caps_draft_at_factor_times_match(factor, expected):
    p = proposer_with_cache([[1, 2, 3, 4, 5, 6, 7, 8]], suffix_decoding_max_spec_factor=factor)
    assert draft_for(p, [2, 3]) == expected  # a 2-token match


def test_global_cache_proposes_an_earlier_requests_output():
    earlier_output = [40, 41, 42, 43, 44, 45, 46, 47]
    p = proposer_with_cache([earlier_output], num_speculative_tokens=5)
    # a new request whose own tokens never contain the continuation
    assert draft_for(p, [7, 8, 40, 41, 42]) == [43, 44, 45]
    assert draft_for(p, [40, 41, 42, 43, 44, 45]) == [46, 47]
    off = proposer_with_cache([earlier_output], suffix_decoding_max_cached_requests=0)
    assert draft_for(off, [7, 8, 40, 41, 42]) == []


def test_only_the_output_enters_the_global_cache():
    p = SuffixProposer()
    p.start_request("a", np.array([1, 2, 3]))
    p.extend("a", [4])
    p.extend("a", np.array([5, 6]))
    p.finish_request("a")
    assert p.global_trie.sequences == {"a": [4, 5, 6]}
    assert draft_for(p, [2, 3]) == []  # the prompt's continuation was not cached


def test_eviction_drops_the_oldest_request_past_max_cached_requests():
    outputs = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    p = proposer_with_cache(outputs, suffix_decoding_max_cached_requests=2)
    assert list(p.cached_request_ids) == ["done1", "done2"]
    assert trie_counts(p.global_trie) == substring_counts(outputs[1:], 24)
    assert draft_for(p, [1, 2]) == []
    assert draft_for(p, [4, 5]) == [6]


def test_depth_bound_limits_match_plus_draft():
    tokens = list(range(1, 11)) + [1, 2, 3, 4, 5]
    shallow = SuffixProposer(suffix_decoding_max_tree_depth=4, suffix_decoding_max_spec_factor=10.0)
    assert draft_for(shallow, tokens) == [6, 7, 8]  # a 1-token match, 4 - 1 tokens
    deep = SuffixProposer(suffix_decoding_max_tree_depth=24, suffix_decoding_max_spec_factor=10.0)
    assert draft_for(deep, tokens) == [6, 7, 8, 9, 10, 1, 2, 3, 4, 5][:24 - 5]


def reference_draft(counts, context, k, factor, min_prob, depth):
    # the draft rule on brute-force substring counts: best score over match lengths, longer on ties
    best, best_score = [], 0.0
    for m in range(1, min(len(context), depth - 1) + 1):
        node = tuple(context[-m:])
        if node not in counts:
            break
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < min(k, int(factor * m + 1e-6), depth - m):
            children = {s[-1]: c for s, c in counts.items() if len(s) == len(node) + 1 and s[:-1] == node}
            if not children:
                break
            token = max(children, key=lambda t: (children[t], -t))
            prob *= children[token] / counts[node]
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            node += (token,)
        if draft and score >= best_score:
            best, best_score = draft, score
    return best


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(sequences, min_size=1, max_size=3), chunk=st.integers(1, 7), depth=st.integers(2, 6))
def test_incremental_extend_equals_substring_counts(seqs, chunk, depth):
    # the sequences grow interleaved, a few tokens at a time, as requests do
    trie = SuffixTrie(depth)
    for offset in range(0, max(map(len, seqs)), chunk):
        for seq_id, seq in enumerate(seqs):
            trie.extend(seq_id, seq[offset:offset + chunk])
    assert trie_counts(trie) == substring_counts(seqs, depth)
    assert trie.root.count == sum(map(len, seqs))


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(sequences, min_size=2, max_size=3), depth=st.integers(2, 6),
       context=st.lists(st.integers(0, 3), min_size=1, max_size=8), k=st.integers(1, 6),
       factor=st.sampled_from([0.5, 1.0, 2.5]), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
def test_speculate_equals_the_rule_on_substring_counts(seqs, depth, context, k, factor, min_prob):
    trie = SuffixTrie(depth)
    for seq_id, seq in enumerate(seqs):
        trie.extend(seq_id, seq)
    expected = reference_draft(substring_counts(seqs, depth), context, k, factor, min_prob, depth)
    assert trie.speculate(context, k, factor, min_prob).token_ids == expected


@settings(max_examples=30, deadline=None)
@given(seqs=st.lists(sequences, min_size=2, max_size=3), depth=st.integers(2, 6))
def test_remove_leaves_the_trie_of_the_rest(seqs, depth):
    trie = SuffixTrie(depth)
    for seq_id, seq in enumerate(seqs):
        trie.extend(seq_id, seq)
        trie.close(seq_id)
    trie.remove(0)
    assert trie_counts(trie) == substring_counts(seqs[1:], depth)
    assert trie.root.count == sum(map(len, seqs[1:]))
    trie.extend("new", seqs[0])  # the remaining nodes still take new occurrences
    assert trie_counts(trie) == substring_counts(seqs[1:] + seqs[:1], depth)


@settings(max_examples=30, deadline=None)
@given(prompt=sequences, output=st.lists(st.integers(0, 3), max_size=20))
def test_stateful_and_stateless_proposals_agree(prompt, output):
    p = SuffixProposer(num_speculative_tokens=5, suffix_decoding_max_tree_depth=6)
    p.start_request("r", prompt)
    p.extend("r", output)
    assert p.propose_request("r").tolist() == p.propose(np.array(prompt + output)).tolist()


def test_bad_options_name_value_and_fix():
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth=1"):
        SuffixProposer(suffix_decoding_max_tree_depth=1)
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob=1.5"):
        SuffixProposer(suffix_decoding_min_token_prob=1.5)
