"""Simulated tau on held-out target answers: teacher-forced drafting with an anchor at every response position.

For a greedy target, the tokens the engine accepts are exactly the target's own greedy answer, so drafting a
block from the true prefix at every position and counting the leading slots whose argmax equals the answer
gives what verification would accept there.  tau(K) = mean over anchors of 1 + min(accepted, K) (the bonus
token included), for every K up to Q - 1, per source of the held-out store.  It averages over all positions
where the engine visits only block starts, so it is a close, cheap proxy rather than the engine's number;
`specjax bench` gives the engine's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specjax.train.store import TokenStore


@partial(jax.jit, static_argnames=("method",))
def _simulate(params, consts, tokens, taps, mask, lengths, anchors, keep, *, method):
    return method.simulate(params, consts, tokens, taps, mask, lengths, anchors, keep)


class HeldOutSet:
    """Held-out sequences of a TokenStore with their target taps computed once (kept on the device)."""

    def __init__(self, target, store: TokenStore, tap_indices, block_size: int, max_len: int = 512,
                 features=None):
        from specjax.train.trainer import batch_features

        self.block_size = block_size
        self.items = []  # (source, arrays for _simulate)
        for index, (rec, toks) in enumerate(store.sequences()):
            toks = toks[:max_len]
            n = len(toks)
            valid = np.arange(rec["prompt_len"], max(rec["prompt_len"], n - block_size + 1))
            if len(valid) == 0:
                continue
            width = -(-n // 64) * 64
            num = -(-len(valid) // 64) * 64
            tokens = np.zeros((1, width), np.int32)
            tokens[0, :n] = toks
            mask = np.zeros((1, width), bool)
            mask[0, rec["prompt_len"]:n] = True
            anchors = np.zeros((1, num), np.int32)
            keep = np.zeros((1, num), bool)
            anchors[0, :len(valid)] = valid
            keep[0, :len(valid)] = True
            taps = batch_features(target, tokens, [index], tap_indices, features)
            self.items.append((rec["source"], (jnp.asarray(tokens), taps, jnp.asarray(mask),
                                               jnp.asarray(np.array([n], np.int32)), jnp.asarray(anchors),
                                               jnp.asarray(keep))))
        if not self.items:
            raise ValueError(f"held-out store {store.path} has no sequence with a full block of response")

    def evaluate(self, method, params, consts) -> dict:
        """{source: {"tau": [tau(K) for K = 1..Q-1], "anchors": n}} plus "all" over every source."""
        per_source: dict[str, list[np.ndarray]] = {}
        for source, arrays in self.items:
            accepted, counted = _simulate(params, consts, *arrays, method=method)
            acc = np.asarray(accepted)[np.asarray(counted)]
            per_source.setdefault(source, []).append(acc)
            per_source.setdefault("all", []).append(acc)
        ks = np.arange(1, self.block_size)
        out = {}
        for source, accs in per_source.items():
            acc = np.concatenate(accs)
            tau = [float(np.mean(1 + np.minimum(acc, k))) if len(acc) else 0.0 for k in ks]
            out[source] = {"tau": [round(t, 4) for t in tau], "anchors": int(len(acc))}
        return out
