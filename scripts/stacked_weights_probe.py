"""What a layer-scanned target would cost on XLA:CPU's float32 products: SmolLM2's 30 MLP blocks (576 -> 2 x 1536
-> 576) over M tokens, with the weights as 30 separate arrays (today's unrolled program), as slices of one stacked
array in an unrolled program, and as a `lax.scan` over the stacked array (xs, or an index into it).  A product whose
weight is a slice of a larger array gets a copy of that slice first, so the stacked forms pay ~14 MB of copies per
layer per step.  Medians of ROUNDS interleaved runs, ms; JSON on stdout
(docs/results/startup/stacked-weights-probe.json).

    python scripts/stacked_weights_probe.py > docs/results/startup/stacked-weights-probe.json
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, D, F = 30, 576, 1536
ROUNDS = 9


def block(x, gate_up, down):
    g = gate_up @ x
    return x + down @ (jax.nn.silu(g[:F]) * g[F:])


def separate(ws, x):
    for gate_up, down in ws:
        x = block(x, gate_up, down)
    return x


def stacked_unrolled(st, x):
    for i in range(LAYERS):
        x = block(x, st[0][i], st[1][i])
    return x


def scan_xs(st, x):
    return jax.lax.scan(lambda x, w: (block(x, *w), None), x, st)[0]


def scan_index(st, x):
    return jax.lax.scan(lambda x, i: (block(x, st[0][i], st[1][i]), None), x, jnp.arange(LAYERS))[0]


def main() -> None:
    rng = np.random.default_rng(0)
    ws = [(jnp.asarray(rng.standard_normal((2 * F, D), np.float32) * 0.02),
           jnp.asarray(rng.standard_normal((D, F), np.float32) * 0.02)) for _ in range(LAYERS)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
    forms = {"separate": (separate, ws), "stacked_unrolled": (stacked_unrolled, stacked),
             "scan_xs": (scan_xs, stacked), "scan_index": (scan_index, stacked)}
    res = {"layers": LAYERS, "d": D, "f": F, "rounds": ROUNDS, "ms": {}}
    for m in (1, 4, 32, 64, 256):
        x = jnp.ones((D, m), jnp.float32)
        fns = {k: (jax.jit(f), w) for k, (f, w) in forms.items()}
        ref = np.asarray(fns["separate"][0](ws, x))
        for k, (f, w) in fns.items():
            np.testing.assert_allclose(np.asarray(f(w, x)), ref, rtol=1e-4, atol=1e-4)
        times = {k: [] for k in fns}
        for _ in range(ROUNDS):
            for k, (f, w) in fns.items():
                t = time.perf_counter()
                f(w, x).block_until_ready()
                times[k].append(time.perf_counter() - t)
        res["ms"][m] = {k: round(1e3 * float(np.median(v)), 2) for k, v in times.items()}
        print(m, res["ms"][m], file=sys.stderr, flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
