"""Paired A/B of `specjax analyze kflat`: a git revision (A) against the working tree (B), interleaved in one run.

    python scripts/kflat_ab.py --base REV [--rounds 3] [--q 1,2,4,8,16] [--drafter DIR] [--out FILE]
    python scripts/kflat_ab.py --a-flags=--no-quant-kernels [...]   # two settings of the working tree

Each round runs A then B as separate processes (same flags, same machine state); the report is the median over
rounds of each q's median, and of the drafter's block costs.

Use it for a change to the cost of a verification step (kernels, attention, the model's layout): `specjax analyze
kflat` times one step that scores q tokens at once (q = 1 is plain decoding; DFlash verifies K + 1 tokens), and
this pairs two revisions, or two flag sets of the working tree, on the same machine state.  For kernel-only changes
at a finer resolution see scripts/kernel_step_ab.py and scripts/kernel_chain_ab.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_kflat(src: str, args, out_dir: str, flags: str = "") -> dict:
    cmd = [sys.executable, "-m", "specjax.cli", "analyze", "kflat", "--q", args.q, "--context", str(args.context),
           "--batch", str(args.batch), "--repeats", str(args.repeats), "--out-dir", out_dir]
    if args.drafter:
        cmd += ["--drafter", args.drafter, "--draft-blocks", args.draft_blocks]
    cmd += flags.split()
    env = {**os.environ, "PYTHONPATH": src}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "kflat.json")) as fh:
        return json.load(fh)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default=None, help="git revision measured as A (default: the working tree)")
    p.add_argument("--a-flags", default="", help="extra `analyze kflat` flags of side A")
    p.add_argument("--b-flags", default="", help="extra `analyze kflat` flags of side B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--q", default="1,2,4,8,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--drafter", default=None)
    p.add_argument("--draft-blocks", default="4,8,16")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base") if args.base else ROOT
        if args.base:
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, args.base], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            runs = {"A": [], "B": []}
            sides = (("A", os.path.join(base, "src"), args.a_flags), ("B", os.path.join(ROOT, "src"), args.b_flags))
            for i in range(args.rounds):
                for name, src, flags in sides:
                    runs[name].append(run_kflat(src, args, os.path.join(tmp, f"{name}{i}"), flags))
                    print(f"round {i + 1} {name}: " + " ".join(f"{r['q']}:{1000 * r['median_s']:.1f}ms"
                                                              for r in runs[name][-1]["results"]), flush=True)
        finally:
            if args.base:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)
    report = {"base": args.base, "a_flags": args.a_flags, "b_flags": args.b_flags, "rounds": args.rounds,
              "context": args.context, "batch": args.batch, "sides": {}}
    for name, recs in runs.items():
        qs = [r["q"] for r in recs[0]["results"]]
        med = {q: statistics.median(rec["results"][i]["median_s"] for rec in recs) for i, q in enumerate(qs)}
        side = {"t_ms": {q: 1000 * v for q, v in med.items()}, "ratio": {q: v / med[qs[0]] for q, v in med.items()}}
        if recs[0].get("draft"):
            blocks = [d["block_size"] for d in recs[0]["draft"]]
            side["draft_ms"] = {b: 1000 * statistics.median(rec["draft"][i]["median_s"] for rec in recs)
                                for i, b in enumerate(blocks)}
            side["draft_over_t1"] = {b: v / side["t_ms"][qs[0]] for b, v in side["draft_ms"].items()}
        report["sides"][name] = side
    a, b = report["sides"]["A"], report["sides"]["B"]
    print(f"{'q':>5} {'A ms':>8} {'A t/t1':>7} {'B ms':>8} {'B t/t1':>7}")
    for q in a["t_ms"]:
        print(f"{q:>5} {a['t_ms'][q]:>8.2f} {a['ratio'][q]:>7.2f} {b['t_ms'][q]:>8.2f} {b['ratio'][q]:>7.2f}")
    for blk in a.get("draft_ms", {}):
        print(f"draft block {blk}: A {a['draft_ms'][blk]:.2f} ms ({a['draft_over_t1'][blk]:.2f} t1)  "
              f"B {b['draft_ms'][blk]:.2f} ms ({b['draft_over_t1'][blk]:.2f} t1)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
