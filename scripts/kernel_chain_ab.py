"""Paired A/B of the quantized matmul kernel (kernels/quant_matmul.cc) of two git revisions on one decode step's chain
of products: SmolLM2-135M's 30 x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) Q4_1 matrices and its
49152x576 Q8_0 head, every matrix a distinct device buffer (111 MB streamed per step, as in decoding), for M = 1, 4, 8
tokens (or any M: the kernels are called directly), the two kernels interleaved in one process; with --xla, XLA's
float32 dot on the same (dequantized) matrices too.  Only the products: no attention, norms or dispatch of a real
step, so a kernel change shows at the resolution a full `specjax analyze kflat` A/B cannot reach on a noisy VM.
Use it while working on kernels/quant_matmul.cc and its headers; confirm on whole steps with
scripts/kernel_step_ab.py.

    python scripts/kernel_chain_ab.py --a HEAD [--b WORKTREE] [--reps 15] [--m 1,4,8] [--out FILE]
    python scripts/kernel_chain_ab.py --a WORKTREE --b-activations int8 [--part layers|head]  # one build, two inputs
    taskset -c 1 python scripts/kernel_chain_ab.py ...   # one core
    python scripts/kernel_chain_ab.py --isa AVX2 ...     # the AVX2 build, on an AVX-512 CPU too

A revision's kernel is built from its kernels/quant_matmul.cc and headers (`git show`); WORKTREE means the working
tree.  The blocks are this checkout's (model/quant.HostBlocks), laid out for each side's activations: revisions
before 0b8db41 take float32 scales, later ones the file's float16 bits, so compare revisions on the same side of
that change.  Each reports the median and
minimum over reps of the whole chain (ms) and B's speedup over A.  Both sides take the default 16-bit integer
activations unless --a-activations / --b-activations say otherwise.  Integer activations: since 62876fd the rows of
an integer-kernel matrix are interleaved by 8 (model/quant.interleave), so pair integer runs of revisions on the
same side of that change too (across it, the older side computes on blocks laid out for the newer: its timing
holds, its output does not; use scripts/kflat_ab.py).
"""

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import ACTIVATIONS, QUANT_HANDLERS, build, cpu_flags, handler_key, isa_flags
from specjax.model.gguf_file import dequantize
from specjax.model.quant import HostBlocks, kernel_product, to_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_DIR = "src/specjax/kernels"
CHAIN = [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536)] * 30 + [
    ("Q8_0", 49152, 576)]


def kernel_sources(rev: str, out: str) -> str:
    """The kernel sources (.cc, .h) of `rev` (or the working tree) copied into out/ -> its quant_matmul.cc."""
    os.makedirs(out, exist_ok=True)
    if rev == "WORKTREE":
        names = os.listdir(os.path.join(ROOT, KERNEL_DIR))
    else:
        names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", f"{rev}:{KERNEL_DIR}"], check=True,
                               capture_output=True, text=True).stdout.split()
    for name in (n for n in names if n.endswith((".cc", ".h"))):
        if rev == "WORKTREE":
            shutil.copyfile(os.path.join(ROOT, KERNEL_DIR, name), os.path.join(out, name))
        else:
            with open(os.path.join(out, name), "wb") as fh:
                fh.write(subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{KERNEL_DIR}/{name}"], check=True,
                                        capture_output=True).stdout)
    return os.path.join(out, "quant_matmul.cc")


def register(rev: str, tag: str, tmp: str, activations: str, isa: str | None = None) -> None:
    """Build `rev`'s kernel (for kernel build `isa`: None native, "AVX2") and register its Q4_1 and Q8_0 handlers
    (float32, int8 or int16 activations) as chain_{tag}_{kind}."""
    source = kernel_sources(rev, os.path.join(tmp, tag))
    lib = ctypes.CDLL(build(source, jax.ffi.include_dir(), os.path.join(tmp, tag, "build"), "g++", tag,
                            isa_flags(isa, cpu_flags())))
    for kind in ("Q4_1", "Q8_0"):
        handler = QUANT_HANDLERS[handler_key(kind, activations)]
        jax.ffi.register_ffi_target(f"chain_{tag}_{kind}", jax.ffi.pycapsule(getattr(lib, handler)), platform="cpu")


def side_matrices(blocks: dict, shapes: list, tag: str, activations: str) -> list:
    """The chain's matrices for side `tag`, laid out for its activations (integer ones: rows interleaved by 8)."""
    def one(s):
        # the kernels never read a QuantMatrix's float32 side: zeros stand in for it (integer ones keep none)
        dense = None if activations != "float32" else jnp.zeros(s[1:], jnp.float32)
        return to_device(blocks[s], dense, f"chain_{tag}_{s[0]}", activations)

    return [one(s) for s in shapes]


def chain(ws, x):
    """The chain's products on the kernel (any M), or on XLA's float32 dot for plain [O, I] arrays."""
    total = jnp.float32(0)
    for w in ws:
        y = w @ x[: w.shape[1]] if isinstance(w, jax.Array) else kernel_product(w, x[: w.shape[1]])
        total = total + y.sum()
    return total


def main() -> int:
    import gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="HEAD", help="git revision of A (or WORKTREE)")
    p.add_argument("--b", default="WORKTREE", help="git revision of B (or WORKTREE)")
    p.add_argument("--m", default="1,4,8", help="tokens per product")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--xla", action="store_true", help="also time XLA's float32 dot on the dequantized matrices")
    p.add_argument("--a-activations", default=ACTIVATIONS[0], choices=ACTIVATIONS, help="default: int16")
    p.add_argument("--b-activations", default=ACTIVATIONS[0], choices=ACTIVATIONS)
    p.add_argument("--part", default="all", choices=["all", "layers", "head"],
                   help="the whole chain, its 120 layer matrices, or the head alone")
    p.add_argument("--isa", default=None, choices=["native", "AVX2"], help="kernel build (default: native)")
    args = p.parse_args()
    chain_shapes = {"all": CHAIN, "layers": CHAIN[:-1], "head": CHAIN[-1:]}[args.part]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        register(args.a, "a", tmp, args.a_activations, args.isa)
        register(args.b, "b", tmp, args.b_activations, args.isa)
        blocks, dense = {}, {}
        for kind, rows, cols in set(chain_shapes):
            data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                        gguf.GGMLQuantizationType[kind])
            blocks[(kind, rows, cols)] = HostBlocks.from_gguf(data, kind)
            if args.xla:
                dense[(kind, rows, cols)] = dequantize(data, gguf.GGMLQuantizationType[kind])
        sides = {tag: side_matrices(blocks, chain_shapes, tag, acts)
                 for tag, acts in (("a", args.a_activations), ("b", args.b_activations))}
        if args.xla:  # every matrix its own buffer, as the kernels' blocks are
            sides["xla"] = [jnp.array(dense[s]) for s in chain_shapes]
        step = jax.jit(chain)
        report = {"a": args.a, "b": args.b, "a_activations": args.a_activations,
                  "b_activations": args.b_activations, "part": args.part,
                  "threads": len(os.sched_getaffinity(0)), "m": {}}
        for m in [int(v) for v in args.m.split(",")]:
            x = jnp.asarray(rng.standard_normal((max(s[2] for s in chain_shapes), m)).astype(np.float32))
            times = {tag: [] for tag in sides}
            totals = {tag: float(step(sides[tag], x)) for tag in times}
            if totals["a"] != totals["b"]:  # the same products summed the same way: equal to the bit
                print(f"M={m}: A and B differ ({totals['a']!r} vs {totals['b']!r})", flush=True)
            for _ in range(args.reps):
                for tag in times:
                    t = time.perf_counter()
                    step(sides[tag], x).block_until_ready()
                    times[tag].append((time.perf_counter() - t) * 1e3)
            row = {f"{tag}_{stat}": round(float(f(v)), 3) for tag, v in times.items()
                   for stat, f in (("median_ms", np.median), ("min_ms", np.min))}
            row["speedup_median"] = round(row["a_median_ms"] / row["b_median_ms"], 3)
            row["a_equals_b"] = totals["a"] == totals["b"]
            report["m"][m] = row
            print(f"M={m}: A {row['a_median_ms']:.2f} ms (min {row['a_min_ms']:.2f})  B {row['b_median_ms']:.2f} ms "
                  f"(min {row['b_min_ms']:.2f})  B speedup {row['speedup_median']:.2f}x"
                  + (f"  XLA {row['xla_median_ms']:.2f} ms" if "xla" in times else ""), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
