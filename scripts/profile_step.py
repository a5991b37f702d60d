"""Where one decode step's time goes: a jax.profiler trace of the step `specjax analyze kflat` times, aggregated
by XLA thunk kind (fusions, FFI kernels, dots), with the share of each.

    python scripts/profile_step.py [--q 4] [--context 512] [--batch 1] [--no-quant-kernels]
                                   [--kernel-activations int8|float32] [--steps 5] [--out DIR]
    python scripts/profile_step.py --drafter [DIR] --q 4     # the DFlash drafter's forward for a block of q

Tracing adds a fixed cost to every thunk, so small thunks read high; use it for where the time goes, not for
how long a step takes (that is `specjax analyze kflat`).  Use it before changing a kernel or the model's layout, to
see which part of a step a change can speed up.  The defaults are the product's (CPU kernels, 16-bit integer
activations).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

from specjax.kernels import ACTIVATIONS


def by_kind(trace_dir: str, steps: int) -> list[tuple[str, float, float, float]]:
    """(kind, ms per step, share, thunks per step) over the XLA worker threads of the trace, largest first."""
    [path] = glob.glob(f"{trace_dir}/plugins/profile/*/*.trace.json.gz")[-1:]
    with gzip.open(path) as fh:
        trace = json.load(fh)
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    total, count = collections.defaultdict(float), collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or names.get((e["pid"], e["tid"]), "").startswith("python"):
            continue
        if e["name"].startswith(("ThunkExecutor", "end:", "ThreadpoolListener")):
            continue
        kind = re.sub(r"\.\d+$", "", e["name"])
        total[kind] += e["dur"]
        count[kind] += 1
    whole = sum(total.values()) or 1.0
    return sorted(((k, v / 1000 / steps, v / whole, count[k] / steps) for k, v in total.items()), key=lambda r: -r[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--q", type=int, default=1, help="tokens verified by the step")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quant-kernels", default=True, action=argparse.BooleanOptionalAction)
    p.add_argument("--kernel-activations", default=ACTIVATIONS[0], choices=ACTIVATIONS, help="default: int16")
    p.add_argument("--out", default=None, help="keep the trace here (default: a temporary directory)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--drafter", nargs="?", const="default", default=None,
                   help="trace the DFlash drafter's forward (a block of --q) instead; default: the shipped one")
    args = p.parse_args()
    from specjax.bench.kflat import draft_step, verify_steps
    from specjax.model.loader import load_model

    model = load_model(args.model, quant_kernels=args.quant_kernels, activations=args.kernel_activations)
    if args.drafter is not None:
        from specjax.llm import build_proposer, default_drafter_path

        path = default_drafter_path() if args.drafter == "default" else args.drafter
        proposer, pweights = build_proposer("dflash", model, path)
        step = draft_step(proposer, pweights, model.weights, args.context, args.q)
    else:
        step = verify_steps(model.config, model.weights, [args.q], args.context, batch=args.batch)[args.q]
    for _ in range(3):
        jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        with jax.profiler.trace(out):
            for _ in range(args.steps):
                jax.block_until_ready(step())
        rows = by_kind(out, args.steps)
    for kind, ms, share, n in rows[:args.top]:
        print(f"{ms:8.2f} ms/step {100 * share:5.1f}%  {n:5.0f} thunks  {kind}")


if __name__ == "__main__":
    main()
