"""Adaptive speculation: pick K per step (K = 0 is plain decoding) to maximise expected tokens per second.

expected_tokens(K) = sum over running requests of E[tau(K)] = 1 + sum_{k<=K} p_k, with p_k = P(draft k accepted)
estimated online from every verified step (exponentially decayed counts, a geometric prior before data);
cost(B, K, Pg) = seconds of a decode step at batch bucket B with K drafts gathering Pg KV pages: the median of
the latest `window` timings of that shape (warm-up runs first, then real steps; a median, because one step
slowed by the host — the HTTP thread, garbage collection — must not flip the choice).  The page bucket is part
of the key since attention over the gathered pages dominates at long contexts, and a step with fewer drafts
may gather fewer pages.

The controller takes argmax_K expected_tokens(K) / cost(B, K, Pg(K)), so when drafts stop paying for their
verification (large batches on a compute-bound CPU, a drafter that misses) it falls back to K = 0: a plain
decoding step plus the proposer's context update (DFlash: fc + K/V rows of the accepted position, measured at
0.7-2% of a step on the 2-core CPU, scripts/k0_step_cost.py at f9c7328).

A step at K refreshes the estimates of p_1..p_K only, so the controller also tries a larger K now and then:
the cheapest one whose rate, with every p_k at the upper end of its confidence interval (Wilson, z = 2, on the
decayed counts), beats the chosen K -> at `explore_budget` of the decode time (this is how it climbs from K = 3
to K = 15 when drafts are good); while K = 0 wins and no K > 0 can win even optimistically, the smallest K > 0
at the smaller `idle_budget` (a drafter that clearly misses costs ~0.3%, not 1%, yet a change of workload
is still noticed).  Exploration period = (cost(K') - cost(K)) / (budget * cost(K)) steps, at least
`min_explore_every`.  (The budget was 3% until a 4-client run with varied request lengths lost 6.6% to plain
decoding, an estimated 1.5-3 points of it to exploration steps at K = 3 / 7 that a batch of 4 could not pay
for.)  Costs go stale too: a shape's timings expire when it has not run for `refresh_every` choices, and a K
cheaper than the chosen one is run once per `refresh_every` steps to re-time it (a K = 0
step timed during start-up contention once kept a single-user server speculating at 0.65x of plain decoding).
"""

from __future__ import annotations

import collections
import math
import statistics

import numpy as np


class AdaptiveK:
    def __init__(self, k_options: tuple[int, ...], max_k: int, explore_budget: float = 0.01,
                 idle_budget: float = 0.003, min_explore_every: int = 8, decay: float = 0.99, window: int = 9,
                 z: float = 2.0, refresh_every: int = 128):
        if explore_budget <= 0 or idle_budget <= 0:
            raise ValueError(f"exploration budgets must be > 0, got {explore_budget}, {idle_budget}")
        self.k_options = tuple(sorted(set(k_options)))
        self.explore_budget = explore_budget
        self.idle_budget = idle_budget
        self.z = z
        self.min_explore_every = min_explore_every
        self.decay = decay
        prior = 0.5 ** np.arange(1, max_k + 1)  # optimistic-but-humble prior: p_k = 0.5^k, worth 2 observations
        self.accepted = 2.0 * prior
        self.drafted = np.full(max_k, 2.0)
        self.samples: dict[tuple[int, int, int], collections.deque] = {}
        self.medians: dict[tuple[int, int, int], float] = {}
        self.taus: dict[bool, np.ndarray] = {}  # 1 + cumsum(p_k), plain and optimistic; reset by new acceptance
        self.measured_at: dict[tuple[int, int, int], int] = {}  # choice count at each shape's latest timing
        self.window = window
        self.refresh_every = refresh_every
        self.num_choices = 0
        self.steps_since_explore = 0

    # ------------------------------------------------------------------------------------------------ costs
    def record_cost(self, batch_bucket: int, k: int, pages: int, seconds: float) -> None:
        key = (batch_bucket, k, pages)
        if key not in self.samples or self.num_choices - self.measured_at[key] >= self.refresh_every:
            self.samples[key] = collections.deque(maxlen=self.window)  # stale timings expire on a new one
        self.samples[key].append(seconds)
        self.medians[key] = statistics.median(self.samples[key])
        self.measured_at[key] = self.num_choices

    def forget_cost(self, batch_bucket: int, k: int, pages: int) -> None:
        """Drop the timings of a shape (the program that runs it changed)."""
        for table in (self.samples, self.medians, self.measured_at):
            table.pop((batch_bucket, k, pages), None)

    def cost(self, batch_bucket: int, k: int, pages: int) -> float | None:
        """Median step time of (B, K, Pg); an unmeasured page bucket borrows the nearest measured one."""
        found = self.medians.get((batch_bucket, k, pages))
        if found is None:
            near = [key for key in self.medians if key[:2] == (batch_bucket, k)]
            if not near:
                return None
            found = self.medians[min(near, key=lambda key: (abs(math.log(key[2] / pages)), key[2]))]
        return found

    # ------------------------------------------------------------------------------------------------ acceptance
    def record_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        # Only the positions observed now decay: each p_k is an average over its own latest ~1 / (1 - decay)
        # observations (positions beyond the explored K keep theirs instead of fading towards 0 / 0).
        self.accepted[:num_drafts] *= self.decay
        self.drafted[:num_drafts] *= self.decay
        self.drafted[:num_drafts] += 1.0
        self.accepted[:num_accepted] += 1.0
        self.taus = {}

    def per_position(self, optimistic: bool = False) -> np.ndarray:
        """p_k = P(a >= k), k = 1..max_k (cumulative, monotone non-increasing); `optimistic`: each p_k at the
        upper end of its Wilson score interval (z standard errors) over the decayed counts."""
        n = self.drafted
        p = np.clip(self.accepted / n, 0.0, 1.0)
        if optimistic:
            z2 = self.z ** 2
            p = (p + z2 / (2 * n) + self.z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (1 + z2 / n)
        return np.minimum.accumulate(np.clip(p, 0.0, 1.0))

    def expected_tau(self, k: int, optimistic: bool = False) -> float:
        """1 + p_1 + ... + p_k (cached between acceptance updates: choose() runs on every decode step)."""
        if optimistic not in self.taus:
            self.taus[optimistic] = 1.0 + np.concatenate([[0.0], np.cumsum(self.per_position(optimistic))])
        return float(self.taus[optimistic][k])

    # ------------------------------------------------------------------------------------------------ choice
    def choose(self, batch_bucket: int, num_seqs: int, pages: dict[int, int], options: tuple[int, ...] = ()) -> int:
        """K for the next step; pages[k] = the page bucket a step with k drafts would gather; `options`: the K
        that may run now (those with a compiled program; default all)."""
        self.num_choices += 1
        k_options = tuple(sorted(options)) if options else self.k_options
        costs, rates = {}, {}
        for k in k_options:
            costs[k] = self.cost(batch_bucket, k, pages[k])
            if costs[k] is None:
                return k  # unmeasured: measure it (warm-up normally fills every entry)
            rates[k] = num_seqs * self.expected_tau(k) / costs[k]
        best = max(k_options, key=lambda k: rates[k])  # ties: the smallest K
        for k in k_options:
            # A cheaper K that is not chosen is never timed again: refresh it now and then, or a cost inflated
            # once (a step timed while another process compiled) would keep speculation on where it loses.
            last = self.measured_at.get((batch_bucket, k, pages[k]), 0)
            if k < best and self.num_choices - last > self.refresh_every:
                return k
        # Exploration: verified steps at `best` refresh p_1..p_best only, so a larger K is tried now and then —
        # the cheapest one that could plausibly beat `best` (at explore_budget), else, while K = 0 wins, the
        # smallest K > 0 (at idle_budget) so that a change of workload is noticed.
        larger = [k for k in k_options if k > best]
        plausible = [k for k in larger if num_seqs * self.expected_tau(k, optimistic=True) / costs[k] > rates[best]]
        if plausible:
            explore, budget = plausible[0], self.explore_budget
        elif best == 0 and larger:
            explore, budget = larger[0], self.idle_budget
        else:
            self.steps_since_explore = 0
            return best
        self.steps_since_explore += 1
        period = max(self.min_explore_every,
                     math.ceil((costs[explore] - costs[best]) / (budget * max(costs[best], 1e-9))))
        if self.steps_since_explore < period:
            return best
        self.steps_since_explore = 0
        return explore
