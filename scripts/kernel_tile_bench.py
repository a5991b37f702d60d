"""Time the block products of kernels/quant_matmul.cc on one thread without XLA (scripts/kernel_tile_bench.cc):
ns per vector of weights for Q4_1, Q8_0 and BF16 matrices at M = 1, 2, 4, 8 tokens.

    taskset -c 0 python scripts/kernel_tile_bench.py [--source DIR] [--out FILE]

--source is a kernels directory (default: this tree's src/specjax/kernels), e.g. another revision's, checked out
elsewhere, for an A/B of an inner-loop change at a resolution the end-to-end benchmarks cannot reach.
"""

import argparse
import json
import os
import subprocess
import tempfile

import jax

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=os.path.join(HERE, "..", "src", "specjax", "kernels"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "tile_bench")
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-ffp-contract=off", "-w", f"-I{args.source}",
                        f"-I{jax.ffi.include_dir()}", os.path.join(HERE, "kernel_tile_bench.cc"), "-o", exe],
                       check=True)
        result = json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)
    result["source"] = os.path.abspath(args.source)
    for c in result["cases"]:
        print(f"{c['kind']:5s} {c['rows']:6d} x {c['cols']:<5d} M={c['m']}: {c['ms']:7.2f} ms  "
              f"{c['ns_per_vector']:.2f} ns / {result['lanes']} weights")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
