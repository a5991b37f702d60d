"""Paired A/B of `specjax bench`: a git revision (A) against the working tree (B), alternating in one run.

Use it before committing a change that could move decoding speed (engine, model, kernels, drafter), to show the
time per output token is unchanged or what it gains: on a shared or virtual machine two separate bench runs
differ by more than most changes, so A and B must alternate on the same machine state.

    python scripts/bench_ab.py --base REV [--rounds 3] [--out FILE] -- --quick --methods ar,dflash@3

Each round runs A (REV checked out in a temporary git worktree) then B as separate processes with the same bench
flags (everything after `--`; default `--quick`); the report is the median over rounds of each (dataset, method)'s
TPOT (ms per output token) and B / A.  It stops if either side's greedy outputs differ from plain decoding's
(the bench's matches_ar): a pair where they do would measure a bug.  The README's table itself comes from one
`specjax bench` run (its command is given there).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(src: str, bench_args: list[str], out_dir: str) -> dict:
    cmd = [sys.executable, "-m", "specjax.cli", "bench", *bench_args, "--out-dir", out_dir]
    env = {**os.environ, "PYTHONPATH": src}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "bench.json")) as fh:
        records = json.load(fh)["records"]
    differ = [f"{r['dataset']}/{r['method']}" for r in records if r.get("matches_ar") is False]
    if differ:
        raise SystemExit(f"{src}: outputs differ from plain decoding's in {', '.join(differ)}")
    return {f"{r['dataset']}/{r['method']}": r["tpot_ms"] for r in records}


def main() -> int:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else ["--quick"]
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision measured as A")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    runs = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.base], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for i in range(args.rounds):
                for name, src in (("A", os.path.join(base, "src")), ("B", os.path.join(ROOT, "src"))):
                    runs[name].append(run_bench(src, bench_args, os.path.join(tmp, f"{name}{i}")))
                    print(f"round {i + 1} {name}: " + " ".join(f"{k} {v:.1f}ms" for k, v in runs[name][-1].items()),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)
    keys = list(runs["A"][0])
    med = {side: {k: statistics.median(r[k] for r in recs) for k in keys} for side, recs in runs.items()}
    report = {"base": args.base, "rounds": args.rounds, "bench_args": bench_args, "tpot_ms": med,
              "b_over_a": {k: med["B"][k] / med["A"][k] for k in keys}, "runs": runs}
    for k in keys:
        print(f"{k:>24}  A {med['A'][k]:7.2f} ms  B {med['B'][k]:7.2f} ms  B/A {report['b_over_a'][k]:.3f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
