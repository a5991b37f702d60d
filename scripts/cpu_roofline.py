"""The floor under a decode / verify step on this CPU: measured float32 FMA peak, integer byte-dot peak and memory
read bandwidth (scripts/cpu_roofline.cc), against the bytes a step streams and the multiply-adds it does per token.

    python scripts/cpu_roofline.py [--model PATH] [--activations int16|int8|float32] [--avx2] [--out FILE]
    specjax analyze kflat --out-dir kf && python scripts/cpu_roofline.py --kflat kf/kflat.json   # floor vs measured
    python scripts/cpu_roofline.py --kflat ab.json:B      # side B of a scripts/kflat_ab.py report

Use it to see how far a step is from what this CPU allows (how much a kernel change can still gain).

For q tokens a step reads every quantized weight block once (bytes B) and does q x M multiply-adds (M = the
weights' count), so t(q) >= max(B / read bandwidth, q M x P / byte-dot peak) on the integer kernels (P byte planes:
1 for int8 activations, 2 for int16), and 2 q M / FMA peak on float32 ones; the kernels' weight unpacking, scales,
and everything that is not a product (attention, norms, sampling) come on top.  With --kflat the measured t(q) are
set beside the floor.  Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile


def measure(avx2: bool = False) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "roofline")
        kernels = os.path.join(here, "..", "src", "specjax", "kernels")
        subprocess.run(["g++", "-O3", "-march=native", *(["-mno-avx512f"] if avx2 else []), "-std=c++17", "-pthread",
                        f"-I{kernels}",
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
            layers = leaf.codes.shape[0] if leaf.codes.ndim == 4 else 1  # a LayerStack's matrices: [L, ...]
            macs += layers * leaf.shape[0] * leaf.shape[1]
    return nbytes, macs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--kflat", default=None,
                   help="kflat.json of `specjax analyze kflat`, or FILE:SIDE of scripts/kflat_ab.py (SIDE A or B)")
    p.add_argument("--q", default="1,2,4,8,16")
    p.add_argument("--activations", default="int16", help="int16, int8 or float32: the products' arithmetic")
    p.add_argument("--avx2", action="store_true", help="the AVX2 build's ceilings on an AVX-512 CPU")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from specjax.model.loader import load_model

    cpu = measure(args.avx2)
    nbytes, macs = streamed(load_model(args.model, quant_kernels=True, activations=args.activations).weights)
    planes = {"int16": 2, "int8": 1}.get(args.activations)
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
        fma = (q * macs * planes / (cpu["dot_gmacs_all"] * 1e9) if planes
               else 2 * q * macs / (cpu["fma_gflops_all"] * 1e9))
        floor[q] = {"memory_ms": 1000 * mem, "arithmetic_ms": 1000 * fma, "floor_ms": 1000 * max(mem, fma),
                    "measured_ms": 1000 * measured[q] if q in measured else None}
    first = floor[min(floor)]["floor_ms"]
    for f in floor.values():
        f["floor_over_t1"] = f["floor_ms"] / first
    out = {"cpu": cpu, "activations": args.activations, "streamed_bytes": nbytes, "macs_per_token": macs,
           "floor": floor}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
