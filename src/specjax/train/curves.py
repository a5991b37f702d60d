"""Learning-curve logs (JSON lines: loss rows, simulated-tau rows, engine-tau rows, cumulative hours) and their plots:
loss and engine tau against steps (curve.png), simulated tau against wall-clock hours (sim-curve.png)."""

from __future__ import annotations

import json
import os


def append_row(log_path: str, row: dict) -> None:
    """Append one row to a learning-curve log."""
    with open(log_path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def plot_curves(log_path: str, png_path: str) -> None:
    """Training loss and engine tau (per evaluation set) against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(log_path)]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval" in r]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue", lw=0.8, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE loss", color="tab:blue")
    if evals:
        ax2 = ax.twinx()
        for name in sorted({k for r in evals for k in r["eval"]}):
            pts = [(r["step"], r["eval"][name]["tau"]) for r in evals if name in r["eval"]]
            ax2.plot(*zip(*pts), "o-", label=f"tau {name}")
        ax2.set_ylabel("tau (held-out, greedy)")
        ax2.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def last_hours(log_path: str) -> float:
    """Cumulative training hours recorded in a learning-curve log (0 if none): resumed runs continue from it."""
    hours = 0.0
    if os.path.exists(log_path):
        with open(log_path) as fh:
            for line in fh:
                try:
                    hours = max(hours, float(json.loads(line).get("hours", 0.0)))
                except (json.JSONDecodeError, AttributeError):
                    continue
    return hours


def read_sim_curve(log_path: str) -> list[tuple[float, dict]]:
    """(cumulative hours, sim dict) for every simulated-tau row of a learning-curve log, in order."""
    rows = []
    with open(log_path) as fh:
        for line in fh:
            row = json.loads(line)
            if "sim" in row:
                rows.append((float(row.get("hours", 0.0)), row["sim"]))
    return rows


def plot_sim_curves(logs: dict[str, str], png_path: str, title: str = "", ks: tuple[int, ...] = (3, 7)) -> None:
    """Simulated tau against wall-clock hours, one line per (run, K), one panel per held-out source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {label: read_sim_curve(path) for label, path in logs.items()}
    sources = sorted({s for rows in curves.values() for _, sim in rows for s in sim})
    fig, axes = plt.subplots(1, len(sources), figsize=(3.2 * len(sources), 3.2), squeeze=False, sharey=True)
    for ax, source in zip(axes[0], sources):
        for (label, rows), color in zip(curves.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
            for k, style in zip(ks, ("-", "--", ":")):
                pts = [(h, sim[source]["tau"][min(k, len(sim[source]["tau"])) - 1]) for h, sim in rows
                       if source in sim]
                if pts:
                    ax.plot(*zip(*pts), style, color=color, marker=".", label=f"{label} K={k}")
        ax.set_title(source, fontsize=9)
        ax.set_xlabel("training hours (wall clock)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("simulated tau (held out)")
    axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
