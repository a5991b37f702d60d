"""Prompt lookup beside a device drafter: an incremental n-gram index of one sequence, and when its drafts are used.

A DFlash (or EAGLE-3) step whose context ends in an n-gram of at least `min_n` tokens seen before verifies the K
tokens that followed that earlier occurrence instead of the drafter's block (EngineConfig.lookup_min_match).  The
index answers what `NgramProposer(min_n, max_n).host_propose` answers (what followed the most recent occurrence of
the longest suffix n-gram, n from max_n down to min_n; `copy_after`) in amortized time independent of the sequence's
length (the first call indexes the prompt: ~8 ms for 2,000 tokens; ~0.7 KB a token, dropped when the sequence finishes):
NgramProposer scans the whole sequence once per n (~0.2-0.4 ms a step at 100-1200 tokens, most of a round's host
time), this looks up one dict per n (tests/spec/test_ngram.py checks the two agree, test_lossless.py the engine's
drafts against it).
"""

from __future__ import annotations

LOOKUP_MAX_N = 8  # the longest suffix n-gram compared: of the occurrences matching this far, the latest is taken


class LookupIndex:
    """The latest end position of every n-gram (min_n <= n <= max_n) of a growing token sequence."""

    def __init__(self, min_n: int, max_n: int | None = None):
        self.min_n, self.max_n = min_n, max(min_n, LOOKUP_MAX_N) if max_n is None else max_n
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_n - min_n + 1)]
        self.indexed = 0  # n-grams ending before this position are in `latest`

    def extend(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Catch up with a sequence that only ever grows (prompt, then its output)."""
        have = len(self.tokens)
        if have < len(prompt_ids):
            self.tokens += prompt_ids[have:]
            have = len(prompt_ids)
        self.tokens += output_ids[have - len(prompt_ids):]

    def match(self) -> tuple[int, int]:
        """(n, end): the longest suffix n-gram (min_n <= n <= max_n) seen before and where its most recent earlier
        occurrence ends, or (0, -1)."""
        t, last = self.tokens, len(self.tokens) - 1
        for end in range(self.indexed, last):  # occurrences must end before the suffix's own last token
            for n, latest in enumerate(self.latest, self.min_n):
                if end + 1 >= n:
                    latest[tuple(t[end + 1 - n:end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = self.latest[n - self.min_n].get(tuple(t[last + 1 - n:]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, k: int) -> list[int]:
        """The k tokens that followed the most recent earlier occurrence of the longest suffix n-gram, or none."""
        n, end = self.match()
        return copy_after(self.tokens, end + 1, k) if n else []


def copy_after(tokens, start: int, k: int) -> list[int]:
    """k tokens copied from `start` on; a copy that reaches the end (an n-gram repeating with a period shorter than
    k, e.g. a run of one token) goes on repeating that period, as the text would if the repeat continued."""
    period = len(tokens) - start  # >= 1: a match always ends before the sequence's last token
    return [int(tokens[start + i % period]) for i in range(k)]


def lookup_min_n(proposer, min_match: int | None, num_draft: int) -> int:
    """The n-gram length at which prompt lookup stands in for `proposer`'s block (EngineConfig.lookup_min_match),
    or 0 where it cannot: off, no drafts, or a host proposer (which drafts on the host already)."""
    return min_match if (min_match and num_draft and proposer.on_device) else 0  # None: off
