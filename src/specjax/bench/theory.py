"""`specjax analyze theory`: acceptance theory fitted to benchmark traces, combined with the verify-cost curve.

Per dataset x method: per-position acceptance p_k = P(a >= k) from the traces; a geometric fit
alpha = (accepted drafts) / (accepted drafts + rejections) (the maximum-likelihood alpha of a geometric
acceptance process truncated at K); predicted E[tau](K) = (1 - alpha^(K+1)) / (1 - alpha) and the empirical
curve 1 + sum_{k<=K} p_k (extended geometrically past the measured K); then
speedup(K) = tau(K) * t(1) / (t(K+1) + t_draft), with t(q) interpolated from `analyze kflat` and t_draft charged on
the steps the drafter drafted (not prompt lookup's: a bench record's `lookup_share`).
"""

from __future__ import annotations

import numpy as np


def fit_record(rec: dict) -> dict | None:
    k_used = rec.get("num_draft_tokens") or 0
    steps = [a - 1 for trace in rec["acceptance_lengths"] for a in trace]  # accepted drafts per step
    if not k_used or not steps:
        return None
    steps = np.asarray(steps)
    accepted = steps.sum()
    rejections = (steps < k_used).sum()
    alpha = float(accepted / (accepted + rejections)) if accepted + rejections else 0.0
    p = np.array([(steps >= k).mean() for k in range(1, k_used + 1)])  # cumulative, p_k = P(a >= k)
    return {"alpha": alpha, "p": p.tolist(), "k_used": int(k_used), "tau_measured": float(1 + steps.mean())}


def expected_tau_geometric(alpha: float, k: int) -> float:
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_tau_empirical(p: list[float], alpha: float, k: int) -> float:
    p = list(p)
    while len(p) < k:  # extend past the measured K with the geometric ratio
        p.append(p[-1] * alpha if p else alpha)
    return 1.0 + float(sum(p[:k]))


def verify_time(kflat: dict, q: int) -> float | None:
    pts = sorted((r["q"], r["median_s"]) for r in kflat["results"])
    qs, ts = zip(*pts)
    if q > qs[-1]:
        return None
    return float(np.interp(q, qs, ts))


def draft_time(kflat: dict, block: int | None) -> float:
    drafts = {r["block_size"]: r["median_s"] for r in kflat.get("draft", [])}
    if not drafts or block is None:
        return 0.0
    blocks = sorted(drafts)
    return float(np.interp(block, blocks, [drafts[b] for b in blocks]))


def analyze(bench: dict, kflat: dict | None, max_k: int = 64) -> list[dict]:
    out = []
    for rec in bench["records"]:
        fit = fit_record(rec)
        if fit is None:
            continue
        ks = list(range(1, max_k + 1))
        row = {"dataset": rec["dataset"], "method": rec["method"], **fit,
               "tau_geometric": [expected_tau_geometric(fit["alpha"], k) for k in ks],
               "tau_empirical": [expected_tau_empirical(fit["p"], fit["alpha"], k) for k in ks],
               "tau_geometric_at_k_used": expected_tau_geometric(fit["alpha"], fit["k_used"])}
        if kflat is not None:
            t1 = verify_time(kflat, 1)
            speed = []
            for k in ks:
                tv = verify_time(kflat, k + 1)
                if tv is None:
                    break
                # A block drafter (DFlash) runs a block of K+1, except on prompt lookup's steps (batch 1: the step
                # skips the drafter, runner.decode_step); chained drafters are not in kflat: cost 0 here.
                td = draft_time(kflat, k + 1) * (1 - (rec.get("lookup_share") or 0.0)) if rec["method"].startswith(
                    "dflash") else 0.0
                speed.append(row["tau_empirical"][k - 1] * t1 / (tv + td))
            row["predicted_speedup"] = speed
            if speed:
                best = int(np.argmax(speed)) + 1
                row["recommended_k"] = best
                row["recommended_speedup"] = speed[best - 1]
        out.append(row)
    return out


def plot_theory(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in rows:
        label = f"{r['method']}/{r['dataset']}"
        ks = np.arange(1, len(r["tau_empirical"]) + 1)
        line, = axes[0].plot(ks, r["tau_empirical"], label=label)
        axes[0].plot(ks, r["tau_geometric"], "--", color=line.get_color(), lw=0.8)
        axes[0].plot([r["k_used"]], [r["tau_measured"]], "o", color=line.get_color())
        if r.get("predicted_speedup"):
            axes[1].plot(np.arange(1, len(r["predicted_speedup"]) + 1), r["predicted_speedup"], label=label,
                         color=line.get_color())
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("K (drafts per step)")
    axes[0].set_ylabel("E[tau]: empirical (solid), geometric (dashed), measured (dot)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("K")
    axes[1].set_ylabel("predicted speedup on this machine")
    axes[1].axhline(1, color="gray", ls="--", lw=0.8)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
