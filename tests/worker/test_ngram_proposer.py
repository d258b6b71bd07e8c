import numpy as np
import pytest

from cbjax.worker.spec.ngram import NgramProposer


def reference(tokens, k, lo, hi):
    # brute force over Python lists: longest n, latest earlier match
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_hand_worked_case():
    p = NgramProposer(3, 1, 3)
    # suffix [2, 3] recurs at index 1; tokens after it are 4, 5, 1
    assert p.propose(np.array([1, 2, 3, 4, 5, 1, 2, 3])).tolist() == [4, 5, 1]
    assert p.propose(np.array([1, 2, 3])).tolist() == []


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
    k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    hi = lo + int(rng.integers(0, 3))
    got = NgramProposer(k, lo, hi).propose(np.array(tokens)).tolist()
    assert got == reference(tokens, k, lo, hi)


def test_bad_config_names_values():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)
