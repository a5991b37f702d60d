"""`specjax analyze kflat`: the cost of one target verification forward for q tokens against a realistic cache.

On accelerators verification is "K-flat" (q = 16 costs about as much as q = 1); on a CPU it is not, and the
ratio t(q)/t(1) decides how many drafts are worth verifying.  Each q is timed as the real decode step (forward
over q new tokens, LM head on all q rows, acceptance) plus the KV commit, median of `repeats` after warm-up.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import runner
from specjax.model.target import init_kv_pages
from specjax.sampling import GREEDY
from specjax.spec.proposer import NoProposer


def time_call(fn, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def verify_costs(tcfg, tweights, qs, context_len: int, repeats: int = 15, batch: int = 1, page_size: int = 16,
                 progress=None) -> list[dict]:
    """Median seconds of one verify step over q tokens after `context_len` cached tokens, for each q."""
    max_tokens = context_len + max(qs)
    pages_per_seq = -(-max_tokens // page_size)
    num_pages = batch * pages_per_seq + 1
    kv = init_kv_pages(tcfg.num_layers, num_pages, page_size, tcfg.num_kv_heads, tcfg.head_dim, tweights.embed.dtype)
    table = np.arange(1, num_pages, dtype=np.int32).reshape(batch, pages_per_seq)
    sampling = runner.SamplingBatch(jnp.zeros(batch), jnp.zeros(batch, jnp.int32), jnp.ones(batch),
                                    jnp.zeros(batch, jnp.int32))
    results = []
    state = {"kv": kv}
    for q in qs:
        k = q - 1
        positions = context_len + np.arange(q)
        slots = (table[:, positions // page_size] * page_size + positions % page_size).astype(np.int32)
        inputs = runner.DecodeBatch(jnp.zeros(batch, jnp.int32), jnp.full(batch, context_len, jnp.int32),
                                    jnp.asarray(slots), jnp.asarray(table), jnp.full(batch, k, jnp.int32),
                                    jnp.zeros((batch, k), jnp.int32))

        def step():
            out = runner.decode_step(tweights, state["kv"], None, None, inputs, sampling, tcfg=tcfg,
                                     proposer=NoProposer(), num_draft=k, mode=GREEDY)
            state["kv"], _ = runner.commit(state["kv"], None, inputs.slots, out[3], out[5], out[4])
            return out[0]

        times = time_call(step, repeats)
        results.append({"q": q, "median_s": statistics.median(times), "min_s": min(times),
                        "p90_s": float(np.quantile(times, 0.9)), "repeats": repeats})
        if progress:
            progress(results[-1])
    base = results[0]["median_s"]
    for r in results:
        r["ratio"] = r["median_s"] / base
    return results


def draft_costs(proposer, pweights, tweights, context_len: int, block_sizes, repeats: int = 15,
                page_size: int = 16) -> list[dict]:
    """Median seconds of one DFlash drafter forward (block of Q) against `context_len` cached context rows."""
    from specjax.spec.proposer import DFlashProposer

    pages = -(-(context_len + 1) // page_size)
    results = []
    for q in block_sizes:
        prop = DFlashProposer(proposer.cfg, q)
        pw = prop.prepare(pweights, tweights)
        state = prop.init_state(pages + 1, page_size, tweights.embed.dtype)
        table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
        fn = jax.jit(lambda pw, st, tw: prop.propose(pw, st, tw, jnp.zeros(1, jnp.int32),
                                                       jnp.full(1, context_len, jnp.int32), table, q - 1))
        times = time_call(lambda: fn(pw, state, tweights), repeats)
        results.append({"block_size": q, "median_s": statistics.median(times), "repeats": repeats})
    return results


def plot_kflat(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    qs = [r["q"] for r in results]
    ax.plot(qs, [r["ratio"] for r in results], "o-", label="measured t(q)/t(1)")
    ax.plot(qs, [1.0] * len(qs), "--", color="gray", label="K-flat (ideal accelerator)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified in one forward (q)")
    ax.set_ylabel("cost relative to q = 1")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
