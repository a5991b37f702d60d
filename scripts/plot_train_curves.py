"""Plot simulated tau against training hours for one or more learning-curve logs (A/Bs, long runs).

  python scripts/plot_train_curves.py --out docs/results/train/ab.png "slot=runs/a/log.jsonl" "no slot=runs/b/log.jsonl"
"""

from __future__ import annotations

import argparse

from specjax.train.simtau import plot_sim_curves


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="LABEL=PATH of a train-drafter log (JSON lines)")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--title", default="")
    p.add_argument("--ks", default="3,7", help="draft lengths K to plot")
    args = p.parse_args()
    logs = dict(item.split("=", 1) for item in args.logs)
    plot_sim_curves(logs, args.out, args.title, tuple(int(k) for k in args.ks.split(",")))


if __name__ == "__main__":
    main()
