"""Where a compiled step program's host memory goes: a decode step of the embedded default (batch 4, K = 3),
serialized (bytes) against the heap it holds once loaded (RSS after `deserialize_and_load` of the same bytes, three
times), with the size of its HLO; and a toy 30-layer MLP compiled unrolled and as a `lax.scan` (the same per-layer
work), whose executables show the same scaling with HLO size.  JSON on stdout
(docs/results/startup/program-memory-probe.json)."""

import gc
import json

import jax
import jax.numpy as jnp
from jax.experimental import serialize_executable

from specjax.engine.engine import GREEDY
from specjax.engine.programs import StepShape
from specjax.hostmem import release_freed_memory, resident_bytes
from specjax.llm import LLM


def rss_mb() -> float:
    gc.collect()
    release_freed_memory()
    return resident_bytes() / 1e6


def toy(res: dict) -> None:
    layers, d, f = 30, 576, 1536
    weights = [(jnp.ones((f, d)), jnp.ones((d, f)), jnp.ones(d)) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *weights)

    def layer(x, w):
        a, b, n = w
        h = x * jax.lax.rsqrt(jnp.mean(x * x, 0, keepdims=True) + 1e-6) * n[:, None]
        return x + b @ jax.nn.silu(a @ h)

    def unrolled(ws, x):
        for w in ws:
            x = layer(x, w)
        return x

    def scanned(ws, x):
        return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]

    keep = []
    for name, fn, ws in (("unrolled", unrolled, weights), ("scan", scanned, stacked)):
        deltas = []
        for m in (5, 6, 7):  # distinct shapes: each compiles
            before = rss_mb()
            keep.append(jax.jit(fn).lower(ws, jnp.ones((d, m))).compile())
            deltas.append(round(rss_mb() - before, 1))
        res[f"toy_{name}_mb_each"] = deltas
        res[f"toy_{name}_hlo_chars"] = len(keep[-1].as_text())


def decode_program() -> tuple[tuple, dict]:
    """The embedded default's decode step (batch 4, the largest K), serialized: ((blob, in_tree, out_tree), sizes)."""
    engine = LLM().engine
    shape = StepShape("decode", 4, engine.k_options[-1], 8, GREEDY)
    step, _ = engine._build_program(shape)
    blob, in_tree, out_tree = serialize_executable.serialize(step)
    text = step.as_text()
    return (blob, in_tree, out_tree), {
        "shape": str(shape), "serialized_mb": round(len(blob) / 1e6, 2), "hlo_chars": len(text),
        "hlo_instructions": sum(1 for line in text.splitlines() if " = " in line), "fusions": text.count(" fusion(")}


def main() -> None:
    (blob, in_tree, out_tree), res = decode_program()
    jax.clear_caches()
    loaded, deltas = [], []
    for _ in range(3):
        before = rss_mb()
        loaded.append(serialize_executable.deserialize_and_load(blob, in_tree, out_tree))
        deltas.append(round(rss_mb() - before, 1))
    res["deserialized_rss_mb_each"] = deltas
    toy(res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
