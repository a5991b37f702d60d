"""`specjax generate` with its default settings against `--method ar`, from process launch (issue #12's "generate
default >= 1.3x"), on the benchmark's prompts: one process per run, the two commands alternated.

    python scripts/generate_ab.py --prompts 3 --out docs/results/generate/default-vs-ar.json

Each run is `specjax generate --max-new-tokens N --json [ARGS]` on one prompt (read from stdin); the JSON line gives
TPOT (seconds per token after the first, compile waits included: what the user sees), TTFT and tau; wall time is
from launch to exit.  Both commands must print the same tokens (greedy: lossless).  `--a-args` / `--b-args`
replace the two argument lists (e.g. `--a-args=--adaptive-k --b-args=` for a within-DFlash A/B), `--a-src` runs A
from another checkout (`git worktree add runs/old REV`, then `--a-src runs/old/src`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time


def run(prompt: str, max_new: int, extra: list[str], src: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": src} if src else None  # src: another checkout's src/ (e.g. a git worktree)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "generate", "--max-new-tokens", str(max_new),
                             "--json", *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    out, err = proc.communicate(prompt.encode())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed: {err.decode()[-2000:]}")
    d = json.loads(out.decode().strip().splitlines()[-1])
    return {"wall_s": wall, "tpot_s": d["tpot_s"], "ttft_s": d["ttft_s"], "tau": d["tau"], "method": d["method"],
            "new_tokens": d["new_tokens"], "token_ids": d["token_ids"], "quant_kernels": d["quant_kernels"],
            "stderr_tail": err.decode().strip().splitlines()[-4:]}


def main() -> None:
    from specjax.datasets import load_eval

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="gsm8k,math500,humaneval,mbpp")
    ap.add_argument("--prompts", type=int, default=3, help="the first N prompts of each dataset (what bench runs)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--a-args", default="", help="arguments of command A (default: none = generate's defaults)")
    ap.add_argument("--b-args", default="--method ar", help="arguments of command B")
    ap.add_argument("--a-src", default=None, help="run A from this src/ directory (default: the installed specjax)")
    ap.add_argument("--b-src", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    a_args, b_args = shlex.split(args.a_args), shlex.split(args.b_args)
    records = []
    for name in args.datasets.split(","):
        for i, p in enumerate(load_eval(name)[: args.prompts]):
            pair = {"dataset": name, "prompt": i}
            sides = [("a", a_args, args.a_src), ("b", b_args, args.b_src)]
            for tag, extra, src in sides if len(records) % 2 == 0 else sides[::-1]:
                pair[tag] = run(p.turns[0], args.max_new_tokens, extra, src)
            pair["equal"] = pair["a"]["token_ids"] == pair["b"]["token_ids"]
            pair["tpot_ratio_b_over_a"] = pair["b"]["tpot_s"] / pair["a"]["tpot_s"]
            pair["wall_ratio_b_over_a"] = pair["b"]["wall_s"] / pair["a"]["wall_s"]
            records.append(pair)
            print(f"{name}/{i}: tpot a {1000 * pair['a']['tpot_s']:.1f} ms (tau {pair['a']['tau']:.2f}), "
                  f"b {1000 * pair['b']['tpot_s']:.1f} ms -> {pair['tpot_ratio_b_over_a']:.2f}x; "
                  f"wall {pair['a']['wall_s']:.1f} / {pair['b']['wall_s']:.1f} s; equal {pair['equal']}",
                  file=sys.stderr)
    summary = {}
    for name in args.datasets.split(","):
        rows = [r for r in records if r["dataset"] == name]
        summary[name] = {
            "tpot_ms_a": statistics.median(1000 * r["a"]["tpot_s"] for r in rows),
            "tpot_ms_b": statistics.median(1000 * r["b"]["tpot_s"] for r in rows),
            "speedup_tpot": statistics.median(r["tpot_ratio_b_over_a"] for r in rows),
            "speedup_wall": statistics.median(r["wall_ratio_b_over_a"] for r in rows),
            "tau_a": statistics.mean(r["a"]["tau"] for r in rows),
            "all_equal": all(r["equal"] for r in rows)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"command": " ".join(sys.argv), "a_args": a_args, "b_args": b_args, "a_src": args.a_src,
                   "b_src": args.b_src,
                   "max_new_tokens": args.max_new_tokens, "summary": summary, "records": records}, fh, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
