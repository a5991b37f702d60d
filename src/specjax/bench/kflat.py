"""`specjax analyze kflat`: the cost of one target verification forward for q tokens against a realistic cache.

On accelerators verification is "K-flat" (q = 16 costs about as much as q = 1); on a CPU it is not, and the
ratio t(q)/t(1) decides how many drafts are worth verifying.  Each q is timed as the real decode step (forward
over q new tokens, LM head on all q rows, acceptance) plus the KV commit, median of `repeats` after warm-up,
the q values interleaved so that their ratios compare the same moments of a noisy machine.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import runner
from specjax.engine.engine import kv_cache_dtype
from specjax.model.target import init_kv_pages, stacks_pools
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
                 progress=None, proposer=None, pweights=None, kv_dtype=None) -> list[dict]:
    """Median seconds of one decode step verifying q tokens after `context_len` cached tokens, for each q.

    With no proposer the step verifies q - 1 zero drafts (the verify cost alone); with a device proposer
    (DFlashProposer) it is the whole speculative step: the drafter proposes q - 1 tokens, the target verifies
    them, and both caches are committed."""
    steps = verify_steps(tcfg, tweights, qs, context_len, batch, page_size, proposer, pweights, kv_dtype)
    for q in qs:  # compile and warm up every q first ...
        time_call(steps[q], 0)
    times = {q: [] for q in qs}
    for _ in range(repeats):  # ... then time them round-robin, so every q sees the same machine (a shared VM drifts)
        for q in qs:
            times[q] += time_call(steps[q], 1, warmup=0)
    results = [{"q": q, "median_s": statistics.median(times[q]), "min_s": min(times[q]),
                "p90_s": float(np.quantile(times[q], 0.9)), "repeats": repeats} for q in qs]
    base = results[0]["median_s"]
    for r in results:
        r["ratio"] = r["median_s"] / base
        if progress:
            progress(r)
    return results


def verify_steps(tcfg, tweights, qs, context_len: int, batch: int = 1, page_size: int = 16, proposer=None,
                 pweights=None, kv_dtype=None) -> dict:
    """{q: step()} for verify_costs (and scripts/profile_step.py): each call runs one decode step of q tokens per
    sequence over its own KV pool (of `kv_dtype`, default the engine's: engine.kv_cache_dtype "auto") and commits
    it; returns the accepted counts (block on them to time it)."""
    proposer = proposer or NoProposer()
    if pweights is not None and hasattr(proposer, "prepare"):
        pweights = proposer.prepare(pweights, tweights)
    max_tokens = context_len + max(qs)
    pages_per_seq = -(-max_tokens // page_size)
    num_pages = batch * pages_per_seq + 1
    kv_dtype = kv_dtype or kv_cache_dtype("auto", tweights)
    kv = init_kv_pages(tcfg.num_layers, num_pages, page_size, tcfg.num_kv_heads, tcfg.head_dim, kv_dtype,
                       stacks_pools(tweights, tcfg, kv_dtype))
    table = np.arange(1, num_pages, dtype=np.int32).reshape(batch, pages_per_seq)
    sampling = runner.SamplingBatch(jnp.zeros(batch), jnp.zeros(batch, jnp.int32), jnp.ones(batch),
                                    jnp.zeros(batch, jnp.int32))
    state = {"kv": kv, "p": proposer.init_state(num_pages, page_size, tweights.embed.dtype)}

    def make_step(q):
        k = q - 1
        positions = context_len + np.arange(q)
        slots = (table[:, positions // page_size] * page_size + positions % page_size).astype(np.int32)
        inputs = runner.DecodeBatch(jnp.zeros(batch, jnp.int32), jnp.full(batch, context_len, jnp.int32),
                                    jnp.asarray(slots), jnp.asarray(table), jnp.full(batch, k, jnp.int32),
                                    jnp.zeros((batch, k), jnp.int32))

        def step():
            out = runner.decode_step(tweights, state["kv"], pweights, state["p"], inputs, sampling, tcfg=tcfg,
                                     proposer=proposer, num_draft=k, mode=GREEDY)
            state["kv"], state["p"] = runner.commit(state["kv"], state["p"], inputs.slots, out[3], out[5], out[4],
                                                    kernel=tweights.kv_write_kernel)
            return out[0]

        return step

    return {q: make_step(q) for q in qs}


def draft_step(proposer, pweights, tweights, context_len: int, block_size: int, page_size: int = 16):
    """One DFlash drafter forward (a block of `block_size`) against `context_len` cached context rows, as a
    callable returning its drafts (block on them to time it): what draft_costs times and scripts/profile_step.py
    traces."""
    from specjax.spec.proposer import DFlashProposer

    pages = -(-(context_len + 1) // page_size)
    prop = DFlashProposer(proposer.cfg, block_size)
    pw = prop.prepare(pweights, tweights)
    state = prop.init_state(pages + 1, page_size, tweights.embed.dtype)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    fn = jax.jit(lambda pw, st, tw: prop.propose(pw, st, tw, jnp.zeros(1, jnp.int32),
                                                   jnp.full(1, context_len, jnp.int32), table, block_size - 1))
    return lambda: fn(pw, state, tweights)


def draft_costs(proposer, pweights, tweights, context_len: int, block_sizes, repeats: int = 15,
                page_size: int = 16) -> list[dict]:
    """Median seconds of one DFlash drafter forward (block of Q) against `context_len` cached context rows."""
    results = []
    for q in block_sizes:
        times = time_call(draft_step(proposer, pweights, tweights, context_len, q, page_size), repeats)
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
