"""Adaptive speculation: pick K per step (K = 0 is plain decoding) to maximise expected tokens per second.

expected_tokens(K) = sum over running requests of E[tau(K)] = 1 + sum_{k<=K} p_k, with p_k = P(draft k accepted)
estimated online from every verified step (exponentially decayed counts, a geometric prior before data);
cost(B, K) = measured seconds of a decode step at batch bucket B with K drafts (warm-up timings, then an
exponential moving average of real steps).  The controller takes argmax_K expected_tokens(K) / cost(B, K), so
when drafts stop paying for their verification (large batches on a compute-bound CPU, a drafter that misses)
it falls back to K = 0: a plain decoding step plus the proposer's context update (DFlash: fc + K/V rows of
the accepted position).  Every `explore_every` steps it verifies the
largest K once, so that acceptance estimates stay current while speculation is off.
"""

from __future__ import annotations

import numpy as np


class AdaptiveK:
    def __init__(self, k_options: tuple[int, ...], max_k: int, explore_every: int = 16, decay: float = 0.99,
                 ema: float = 0.2):
        self.k_options = tuple(sorted(set(k_options)))
        self.max_k = max_k
        self.explore_every = explore_every
        self.decay = decay
        self.ema = ema
        prior = 0.5 ** np.arange(1, max_k + 1)  # optimistic-but-humble prior: p_k = 0.5^k, worth 2 observations
        self.accepted = 2.0 * prior
        self.drafted = np.full(max_k, 2.0)
        self.cost: dict[tuple[int, int], float] = {}
        self.steps = 0

    def record_cost(self, batch_bucket: int, k: int, seconds: float) -> None:
        key = (batch_bucket, k)
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def record_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.accepted *= self.decay
        self.drafted *= self.decay
        self.drafted[:num_drafts] += 1.0
        self.accepted[:num_accepted] += 1.0

    def per_position(self) -> np.ndarray:
        """p_k = P(a >= k), k = 1..max_k (cumulative, monotone non-increasing)."""
        return np.minimum.accumulate(np.clip(self.accepted / self.drafted, 0.0, 1.0))

    def expected_tau(self, k: int) -> float:
        return 1.0 + float(self.per_position()[:k].sum())

    def choose(self, batch_bucket: int, num_seqs: int) -> int:
        self.steps += 1
        if self.max_k and self.steps % self.explore_every == 0:
            return self.k_options[-1]
        best, best_rate = self.k_options[0], -1.0
        for k in self.k_options:
            cost = self.cost.get((batch_bucket, k))
            if cost is None:
                return k  # unmeasured: measure it (warm-up normally fills every entry)
            rate = num_seqs * self.expected_tau(k) / cost
            if rate > best_rate:
                best, best_rate = k, rate
        return best
