"""`specjax check-lossless`: a statistical check that a speculative method samples what plain decoding samples.

Speculative decoding at T > 0 is lossless when the tokens it emits follow the target's distribution exactly, and
no finite run proves that; what a run can do is look for a difference large enough to matter and say how large a
difference it would have seen.  The check draws `samples` completions of `positions` tokens from one prompt with
plain decoding and as many with the method under test, each request with its own seed (the two runs use disjoint
seeds: with equal seeds specjax's position-keyed sampling would make them equal token for token, which tests
the coupling, not the distribution), then for every depth d = 1..positions compares the distributions of the
first d tokens (so depth 2 covers the second token's law given the first) with a two-sample Pearson chi-square
test:

    X^2 = sum_c (a_c sqrt(N_b / N_a) - b_c sqrt(N_a / N_b))^2 / (a_c + b_c),   df = cells - 1,

over cells holding at least `min_cell` draws of both runs together (the rest pooled into one "other" cell).
Depths are corrected with Bonferroni: the check fails when any depth's p-value is below alpha / positions.

Power, stated per depth: for two samples of N draws the noncentrality is N * sum (p - q)^2 / (p + q) >=
2 N TV(p, q)^2 (Cauchy-Schwarz), so the depth detects, with probability `power`, any difference in total
variation of at least sqrt(lambda* / (2 N)), lambda* the noncentrality at which a chi-square test with that depth's
df and level reaches `power` (scipy's noncentral chi-square).  At 20,000 draws each, alpha 0.01 over 3 depths,
df 10-60: 0.028-0.038.
"""

from __future__ import annotations

import numpy as np
from scipy import optimize, stats


def draw(engine, prompt_ids: list[int], n: int, first_seed: int, positions: int, temperature: float,
         top_p: float = 1.0, top_k: int = 0) -> tuple[np.ndarray, dict]:
    """n completions of `positions` tokens from one engine (request i seeded first_seed + i, EOS ignored) ->
    (tokens [n, positions], the speculation's counts: decode steps, drafted and accepted tokens)."""
    from specjax.sampling import SamplingParams

    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=positions,
                             ignore_eos=True, seed=first_seed + i) for i in range(n)]
    seqs = engine.generate([list(prompt_ids)] * n, params)
    counts = {"steps": sum(len(s.stats.acceptance_lengths) for s in seqs),
              "drafted": sum(s.stats.num_drafted for s in seqs), "accepted": sum(s.stats.num_accepted for s in seqs)}
    return np.array([s.output_ids for s in seqs], np.int64), counts


def prefix_cells(a: np.ndarray, b: np.ndarray, depth: int, min_cell: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Counts of each first-`depth`-token prefix in samples a [N_a, L] and b [N_b, L] -> (counts a, counts b,
    labels): prefixes seen at least `min_cell` times in both together, most common first, then "other"."""
    keys_a = [tuple(r) for r in a[:, :depth].tolist()]
    keys_b = [tuple(r) for r in b[:, :depth].tolist()]
    pooled: dict[tuple, int] = {}
    for k in keys_a + keys_b:
        pooled[k] = pooled.get(k, 0) + 1
    kept = sorted((k for k, n in pooled.items() if n >= min_cell), key=lambda k: -pooled[k])
    index = {k: i for i, k in enumerate(kept)}
    other = len(kept)
    count_a = np.bincount([index.get(k, other) for k in keys_a], minlength=other + 1)
    count_b = np.bincount([index.get(k, other) for k in keys_b], minlength=other + 1)
    labels: list = kept + ["other"]
    if count_a[other] + count_b[other] < min_cell:  # too few to stand alone: fold it into the rarest kept cell
        if other == 0:
            return count_a, count_b, labels
        count_a[other - 1] += count_a[other]
        count_b[other - 1] += count_b[other]
        count_a, count_b, labels = count_a[:-1], count_b[:-1], labels[:-1]
        labels[-1] = "other"
    return count_a, count_b, labels


def two_sample_chi2(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Pearson's two-sample statistic over cells with counts a and b -> (X^2, degrees of freedom)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = a.sum(), b.sum()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    x2 = float(np.sum((a * np.sqrt(nb / na) - b * np.sqrt(na / nb)) ** 2 / (a + b)))
    return x2, int(keep.sum()) - 1


def detectable_tv(df: int, level: float, power: float, n: int) -> float:
    """The smallest total variation a two-sample chi-square test (df, level) over n + n draws detects with
    probability `power` (see the module docstring)."""
    if df < 1:
        return 1.0
    crit = stats.chi2.isf(level, df)
    lam = optimize.brentq(lambda x: stats.ncx2.sf(crit, df, x) - power, 1e-6, 1e6)
    return float(min(1.0, np.sqrt(lam / (2 * n))))


def compare(plain: np.ndarray, spec: np.ndarray, alpha: float = 0.01, power: float = 0.9,
            min_cell: int = 10) -> dict:
    """The check over plain [N, L] and speculative [N, L] samples -> a report: per depth the cells, X^2, df,
    p-value, empirical TV, detectable TV and verdict; `passed` for all of them."""
    positions = plain.shape[1]
    level = alpha / positions
    depths = []
    for d in range(1, positions + 1):
        ca, cb, labels = prefix_cells(plain, spec, d, min_cell)
        x2, df = two_sample_chi2(ca, cb)
        p = float(stats.chi2.sf(x2, df)) if df > 0 else 1.0
        tv = 0.5 * float(np.abs(ca / ca.sum() - cb / cb.sum()).sum())
        depths.append({"depth": d, "cells": len(labels), "chi2": x2, "df": df, "p_value": p, "tv": tv,
                       "detectable_tv": detectable_tv(df, level, power, min(len(plain), len(spec))),
                       "passed": p >= level, "top": [[str(lab), int(x), int(y)]
                                                     for lab, x, y in zip(labels[:12], ca[:12], cb[:12])]})
    return {"samples": [len(plain), len(spec)], "positions": positions, "alpha": alpha, "level_per_depth": level,
            "power": power, "depths": depths, "passed": all(d["passed"] for d in depths)}


def plot(report: dict, path: str, names: tuple[str, str] = ("plain", "speculative")) -> None:
    """Per depth, the most common prefixes' frequencies in both runs, side by side, with the test's p-value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = report["depths"]
    fig, axes = plt.subplots(1, len(depths), figsize=(4.2 * len(depths), 3.4), squeeze=False)
    for ax, d in zip(axes[0], depths):
        top = d["top"]
        x = np.arange(len(top))
        na, nb = report["samples"]
        ax.bar(x - 0.2, [t[1] / na for t in top], 0.4, label=names[0])
        ax.bar(x + 0.2, [t[2] / nb for t in top], 0.4, label=names[1])
        ax.set_xticks(x, [t[0] if t[0] == "other" else "".join(c for c in t[0] if c not in "()' ") for t in top],
                      rotation=60, fontsize=6)
        verdict = "pass" if d["passed"] else "FAIL"
        ax.set_title(f"first {d['depth']} token(s): p = {d['p_value']:.3g} ({verdict})\n"
                     f"TV {d['tv']:.3f}, detectable {d['detectable_tv']:.3f}", fontsize=8)
        ax.set_ylabel("frequency")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
