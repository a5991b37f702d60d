"""n-gram prompt lookup: what it proposes, and the incremental index that assists device drafters."""

import numpy as np
import pytest

from specjax.config import ConfigError
from specjax.spec.lookup import LookupIndex
from specjax.spec.proposer import NgramProposer


def test_proposes_what_followed_the_most_recent_longest_match():
    p = NgramProposer(max_draft_tokens=3, min_n=1, max_n=3)
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    assert p.host_propose(tokens, 3) == [2, 5, 6]  # "5 6 7" last seen at 4..6, followed by 2 5 6
    assert p.host_propose([1, 2, 3, 9, 9, 3], 2) == [9, 9]  # falls back to n = 1 ("3" at index 2)
    assert p.host_propose([1, 2, 3, 4], 2) == []  # no earlier occurrence
    assert p.host_propose([4, 4], 3) == [4, 4, 4]  # a copy that runs into the end repeats its period
    assert p.host_propose([1, 7, 8, 7, 8], 3) == [7, 8, 7]  # "7 8" at 1..2: "7 8", then that copy again
    assert p.host_propose([7, 8, 9, 7, 8], 4) == [9, 7, 8, 9]
    assert NgramProposer(max_draft_tokens=2, min_n=2, max_n=2).host_propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]


def test_invalid_ngram_settings():
    with pytest.raises(ConfigError, match="1 <= min_n <= max_n"):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ConfigError, match="num_draft_tokens must be >= 1"):
        NgramProposer(max_draft_tokens=0)


def test_incremental_index_proposes_what_the_whole_sequence_scan_proposes():
    """LookupIndex (the engine's prompt lookup beside a drafter) against NgramProposer, its slow oracle, on random
    sequences over small vocabularies (many repeats), grown a few tokens at a time past a prompt."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        vocab, length = int(rng.integers(2, 6)), int(rng.integers(1, 60))
        min_n = int(rng.integers(1, 5))
        max_n = max(min_n, int(rng.integers(1, 9)))
        tokens = [int(t) for t in rng.integers(0, vocab, length)]
        prompt_len = int(rng.integers(0, length))
        oracle, index = NgramProposer(max_draft_tokens=3, min_n=min_n, max_n=max_n), LookupIndex(min_n, max_n)
        for end in range(prompt_len, length + 1, int(rng.integers(1, 4))):
            index.extend(tokens[:prompt_len], tokens[prompt_len:end])
            assert index.propose(3) == oracle.host_propose(tokens[:end], 3), (tokens[:end], min_n, max_n)
