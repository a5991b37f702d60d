"""Time one call of the paged attention a decode / verify step makes per layer (the in-place CPU kernel plus the
XLA merge with the step's own rows, model/attention.py `pages_and_new_attention`), at SmolLM2's shape (9 query
heads, 3 KV heads, head_dim 64, pages of 16), batch 1, against random pools.

    python scripts/attention_call_bench.py [--reps 2000] [--chain 30] [--out FILE]
    PYTHONPATH=/path/to/other/tree/src python scripts/attention_call_bench.py     # another revision's kernel

Prints (and writes) the minimum and median microseconds per call for each (context, queries).  One call per jitted
function (the default) includes jax's dispatch (at context 128 on the AVX2 VM: ~27 us a call, ~10-17 us chained);
`--chain N` times N calls chained inside one program instead, each reading its own layer of a stacked pool
([N, K, P, Z, H], as a decode step reads its layers), so what it reports is the kernel's own cost in a step.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import quant_kernels
from specjax.model.attention import PoolView, pages_and_new_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--cases", default="512:1,1024:1,1024:4,2048:1", help="context:queries, comma-separated")
    p.add_argument("--kv-dtype", default="float16", choices=("float32", "float16", "bfloat16"),
                   help="the pools' and new rows' dtype (the engine's GGUF default: float16)")
    p.add_argument("--chain", type=int, default=1,
                   help="calls per program, each on its own layer of a stacked pool (1 = one call, dispatch included)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kernel = quant_kernels().attention
    rng = np.random.default_rng(0)
    kv_heads, heads, head_dim, page = 3, 9, 64, 16
    rows = []
    for case in args.cases.split(","):
        ctx, t = (int(x) for x in case.split(":"))
        pages = ctx // page + 2
        layers = args.chain
        shape = (layers, kv_heads, pages, page, head_dim) if layers > 1 else (kv_heads, pages, page, head_dim)
        k_pool = jnp.asarray(rng.normal(size=shape).astype(np.float32), args.kv_dtype)
        v_pool = k_pool * 0.5
        table = jnp.arange(1, pages, dtype=jnp.int32)[None]
        q = jnp.asarray(rng.normal(size=(1, t, heads, head_dim)).astype(np.float32))
        k_new = jnp.asarray(rng.normal(size=(1, t, kv_heads, head_dim)).astype(np.float32), args.kv_dtype)
        visible = jnp.ones((1, t, t), bool)

        def calls(q, kp, vp, table, kn, vis, ctx=ctx, layers=layers):
            for layer in range(layers):  # each call's queries are the last one's output: they run in order
                pools = (PoolView(kp, layer), PoolView(vp, layer)) if layers > 1 else (kp, vp)
                q = pages_and_new_attention(q, *pools, table, jnp.array([ctx]), kn, kn, vis, head_dim ** -0.5,
                                            kernel)
            return q

        call = jax.jit(calls)
        inputs = (q, k_pool, v_pool, table, k_new, visible)
        for _ in range(20):
            jax.block_until_ready(call(*inputs))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(call(*inputs))
            times.append(time.perf_counter() - t0)
        us = np.array(times) * 1e6 / layers
        rows.append({"context": ctx, "queries": t, "min_us": float(us.min()), "median_us": float(np.median(us))})
        print(f"context {ctx:5d}  queries {t}: min {us.min():7.1f} us  median {np.median(us):7.1f} us")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"reps": args.reps, "kv_dtype": args.kv_dtype, "chain": args.chain, "results": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
