"""The floor under a decode / verify step on this CPU: measured float32 FMA peak and memory read bandwidth
(scripts/cpu_roofline.cc), against the bytes a step streams and the multiply-adds it does per token.

    python scripts/cpu_roofline.py [--model PATH] [--kflat docs/results/kernels/avx2-kflat-ab-b1.json:B] [--out FILE]

For q tokens a step reads every quantized weight block once (bytes B) and does q x M multiply-adds (M = the
weights' count), so t(q) >= max(B / read bandwidth, 2 q M / FMA peak); the kernels' weight decoding and
everything that is not a product (attention, norms, sampling) come on top.  With --kflat the measured t(q) are
set beside the floor.  Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile


def measure() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "roofline")
        kernels = os.path.join(here, "..", "src", "specjax", "kernels")
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-pthread", f"-I{kernels}",
                        os.path.join(here, "cpu_roofline.cc"), "-o", exe], check=True)
        return json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)


def streamed(weights) -> tuple[int, int]:
    """(bytes the kernels stream, multiply-adds per token) over the quantized matrices of a target."""
    import jax

    from specjax.model.quant import QuantMatrix

    nbytes = macs = 0
    for leaf in jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, QuantMatrix)):
        if isinstance(leaf, QuantMatrix):
            nbytes += sum(a.nbytes for a in (leaf.codes, leaf.scales, leaf.mins) if a is not None)
            macs += leaf.shape[0] * leaf.shape[1]
    return nbytes, macs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--kflat", default=None,
                   help="kflat.json of `specjax analyze kflat`, or FILE:SIDE of scripts/kflat_ab.py (SIDE A or B)")
    p.add_argument("--q", default="1,2,4,8")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from specjax.model.loader import load_model

    cpu = measure()
    nbytes, macs = streamed(load_model(args.model, quant_kernels=True).weights)
    measured = {}
    if args.kflat:
        path, _, side = args.kflat.partition(":")
        with open(path) as fh:
            data = json.load(fh)
        if side:
            measured = {int(q): ms / 1000 for q, ms in data["sides"][side]["t_ms"].items()}
        else:
            measured = {r["q"]: r["median_s"] for r in data["results"]}
    floor = {}
    for q in (int(x) for x in args.q.split(",")):
        mem = nbytes / (cpu["read_gbs_all"] * 1e9)
        fma = 2 * q * macs / (cpu["fma_gflops_all"] * 1e9)
        floor[q] = {"memory_ms": 1000 * mem, "fma_ms": 1000 * fma, "floor_ms": 1000 * max(mem, fma),
                    "measured_ms": 1000 * measured[q] if q in measured else None}
    out = {"cpu": cpu, "streamed_bytes": nbytes, "macs_per_token": macs, "floor": floor}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
