"""In-process paired A/B of the native kernels (kernels/*.cc) of two git revisions on whole decode / verify steps of
the embedded target.  Use it for a change to the CPU kernels whose effect on a step is smaller than the noise of a
process-level A/B: both revisions' kernels are built and registered in one process, the model is loaded once, A's
weights are B's with A's kernel targets, and the two steps alternate in short bursts (either first in turn), so
both see the same phases of a noisy VM (a process-level A/B, scripts/kflat_ab.py, moves 10-20% between rounds
there; the null, A = B, reads 0.993-1.005x here).

    python scripts/kernel_step_ab.py --a HEAD [--b WORKTREE] [--q 1,4] [--context 512] [--batch 1] [--bursts 300]
                                     [--a-kv-dtype float32 --b-kv-dtype float16]
                                     [--a-activations int8 --b-activations int16] [--out FILE]
    python scripts/kernel_step_ab.py --a WORKTREE --a-activations int8   # the default int16 against int8

Only the kernels differ: the Python of the step (model, XLA) is the working tree's, and both kernels compute on the
working tree's weight layout, so pair revisions whose kernels take the same layout (model/quant.py); the integer
activation types share it, so each side may take its own (default: int16, the product's default; a revision
without int16 handlers: int8 only).
Revisions whose kernels/workers.h differ must name different namespaces (their helpers would be shared otherwise).
Reports per q the median step time of each and B's speedup (the median over bursts of A / B of adjacent bursts).
"""

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_chain_ab import kernel_sources  # noqa: E402

from specjax.kernels import (  # noqa: E402
    ATTENTION_HANDLER,
    ATTENTION_SOURCE,
    KV_WRITE_HANDLER,
    KV_WRITE_SOURCE,
    QUANT_HANDLERS,
    QUANT_SOURCE,
    build,
    cpu_flags,
    quant_kernels,
)


def register(src_dir: str, cache: str, label: str) -> dict[str, str]:
    """Build and register the kernels in src_dir -> {handler symbol: FFI target name}."""
    names = {}
    compiler = os.environ.get("CXX") or "g++"
    for source, symbols in ((QUANT_SOURCE, QUANT_HANDLERS.values()), (ATTENTION_SOURCE, [ATTENTION_HANDLER]),
                            (KV_WRITE_SOURCE, [KV_WRITE_HANDLER])):
        path = build(os.path.join(src_dir, source), jax.ffi.include_dir(), cache, compiler,
                     jax.__version__ + cpu_flags())
        lib = ctypes.CDLL(path)
        for symbol in (s for s in symbols if hasattr(lib, s)):  # an older revision lacks newer handlers
            names[symbol] = f"ab_{label}_{symbol.lower()}_{os.path.basename(path)[:-3].rsplit('-', 1)[1]}"
            jax.ffi.register_ffi_target(names[symbol], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return names


def retarget(weights, mapping: dict[str, str]):
    """The target weights with every kernel target renamed by `mapping` (the arrays shared)."""
    from specjax.model.quant import QuantMatrix

    def swap(leaf):
        return dataclasses.replace(leaf, target=mapping[leaf.target]) if isinstance(leaf, QuantMatrix) else leaf

    out = jax.tree_util.tree_map(swap, weights, is_leaf=lambda x: isinstance(x, QuantMatrix))
    return dataclasses.replace(out, attention_kernel=mapping.get(out.attention_kernel),
                               kv_write_kernel=mapping.get(out.kv_write_kernel))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="git revision (or WORKTREE)")
    p.add_argument("--b", default="WORKTREE")
    p.add_argument("--q", default="1,4")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--bursts", type=int, default=300, help="A/B burst pairs per q")
    p.add_argument("--steps", type=int, default=2, help="steps per burst")
    p.add_argument("--a-kv-dtype", default=None, help="A's KV pool dtype (default: the engine's \"auto\")")
    p.add_argument("--b-kv-dtype", default=None, help="B's KV pool dtype")
    p.add_argument("--a-activations", default="int16", choices=("int16", "int8"), help="A's integer activations")
    p.add_argument("--b-activations", default="int16", choices=("int16", "int8"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from specjax.bench.kflat import verify_steps
    from specjax.model.loader import load_model

    model = load_model(None, quant_kernels=True, activations="int8")  # int8 targets; each side swaps in its own
    ours = quant_kernels()
    loaded = {**{ours.targets[k]: QUANT_HANDLERS[k] for k in ours.targets},
              ours.attention: ATTENTION_HANDLER, ours.kv_write: KV_WRITE_HANDLER}  # target -> handler symbol
    qs = [int(x) for x in args.q.split(",")]
    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, rev in (("a", args.a), ("b", args.b)):
            names = register(os.path.dirname(kernel_sources(rev, os.path.join(tmp, label))), os.path.join(tmp, "so"),
                             label)
            suffix = "I16" if getattr(args, f"{label}_activations") == "int16" else "I8"
            mine = {t: h[:-2] + suffix if h.endswith("I8") else h for t, h in loaded.items()}
            weights = retarget(model.weights, {t: names[h] for t, h in mine.items() if h in names})
            steps[label] = verify_steps(model.config, weights, qs, args.context, batch=args.batch,
                                        kv_dtype=getattr(args, f"{label}_kv_dtype"))
    report = {"a": args.a, "b": args.b, "a_kv_dtype": args.a_kv_dtype, "b_kv_dtype": args.b_kv_dtype,
              "a_activations": args.a_activations, "b_activations": args.b_activations,
              "context": args.context, "batch": args.batch, "results": {}}
    for q in qs:
        for label in "ab":
            for _ in range(5):
                jax.block_until_ready(steps[label][q]())
        times = {"a": [], "b": []}
        for i in range(args.bursts):
            for label in ("ab" if i % 2 else "ba"):  # either order in turn: neither runs always first
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    jax.block_until_ready(steps[label][q]())
                times[label].append((time.perf_counter() - t0) / args.steps * 1e3)
        ratio = statistics.median(a / b for a, b in zip(times["a"], times["b"]))
        row = {"a_ms": statistics.median(times["a"]), "b_ms": statistics.median(times["b"]), "b_speedup": ratio,
               "b_wins": sum(a > b for a, b in zip(times["a"], times["b"])), "bursts": args.bursts}
        report["results"][q] = row
        print(f"q={q}: A {row['a_ms']:.2f} ms  B {row['b_ms']:.2f} ms  B speedup {ratio:.3f}x "
              f"(B faster in {row['b_wins']}/{args.bursts} bursts)", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
