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

from specjax.train.features import batch_features
from specjax.train.store import TokenStore


@partial(jax.jit, static_argnames=("method",))
def _simulate(params, consts, tokens, taps, mask, lengths, anchors, keep, context=None, *, method):
    more = () if context is None else (context,)  # a DFlash drafter's context vocabulary (sim_context_vocab)
    return method.simulate(params, consts, tokens, taps, mask, lengths, anchors, keep, *more)


class HeldOutSet:
    """Held-out sequences of a TokenStore with their target taps computed once, padded to one shape (one compile)
    and evaluated `rows` sequences per call."""

    def __init__(self, target, store: TokenStore, tap_indices, block_size: int, max_len: int = 512,
                 features=None, rows: int = 4):
        self.block_size = block_size
        seqs = []
        for index, (rec, toks) in enumerate(store.sequences()):
            toks = toks[:max_len]
            valid = np.arange(rec["prompt_len"], max(rec["prompt_len"], len(toks) - block_size + 1))
            if len(valid):
                seqs.append((index, rec, toks, valid))
        if not seqs:
            raise ValueError(f"held-out store {store.path} has no sequence with a full block of response")
        width = -(-max(len(t) for _, _, t, _ in seqs) // 64) * 64
        num = -(-max(len(v) for *_, v in seqs) // 64) * 64
        total = -(-len(seqs) // rows) * rows
        tokens = np.zeros((total, width), np.int32)
        mask = np.zeros((total, width), bool)
        lengths = np.ones((total,), np.int32)
        anchors = np.zeros((total, num), np.int32)
        keep = np.zeros((total, num), bool)
        self.sources = [rec["source"] for _, rec, _, _ in seqs] + [None] * (total - len(seqs))
        self.indices = [index for index, *_ in seqs]  # the store's sequences evaluated (those with a full block)
        for r, (_, rec, toks, valid) in enumerate(seqs):
            tokens[r, :len(toks)] = toks
            mask[r, rec["prompt_len"]:len(toks)] = True
            lengths[r] = len(toks)
            anchors[r, :len(valid)] = valid
            keep[r, :len(valid)] = True
        self.chunks = []
        for c in range(0, total, rows):
            idx = [seqs[r][0] for r in range(c, min(c + rows, len(seqs)))]
            sl = slice(c, c + rows)
            if features is None:  # one target forward over the whole chunk (padding rows included: one shape)
                taps = batch_features(target, tokens[sl], idx, tap_indices)
            else:
                taps = batch_features(target, tokens[c:c + len(idx)], idx, tap_indices, features)
                taps = jnp.concatenate([taps, jnp.zeros((rows - len(idx),) + taps.shape[1:], taps.dtype)])
            self.chunks.append((jnp.asarray(tokens[sl]), taps, jnp.asarray(mask[sl]), jnp.asarray(lengths[sl]),
                                jnp.asarray(anchors[sl]), jnp.asarray(keep[sl])))

    def accepted_per_anchor(self, method, params, consts) -> list[np.ndarray]:
        """Per held-out sequence, the drafts accepted at each anchor (answer position order)."""
        out = []
        size = getattr(method, "sim_context_vocab", 0)
        for c, arrays in enumerate(self.chunks):
            context = method.context_ids(arrays[0], arrays[2], size) if size else None
            context = None if context is None else jnp.asarray(context)
            accepted, counted = (np.asarray(a) for a in _simulate(params, consts, *arrays, context, method=method))
            out += [accepted[r][counted[r]] for r in range(accepted.shape[0])
                    if self.sources[c * accepted.shape[0] + r] is not None]
        return out

    def evaluate(self, method, params, consts, walks: list[np.ndarray] | None = None) -> dict:
        """{source: {"tau": [tau(K) for K = 1..Q-1], "tau_block_start": [...], "anchors": n}} plus "all" over
        every source.  "tau" averages over every anchor; "tau_block_start" only over the anchors the engine visits
        (`block_start_tau`), which is what `specjax bench` measures.  `walks`: accepted_per_anchor's result, if
        the caller has it already."""
        per_source: dict[str, list[np.ndarray]] = {}
        live = [s for s in self.sources if s is not None]
        walks = self.accepted_per_anchor(method, params, consts) if walks is None else walks
        for source, acc in zip(live, walks):
            per_source.setdefault(source, []).append(acc)
            per_source.setdefault("all", []).append(acc)
        ks = np.arange(1, self.block_size)
        out = {}
        for source, accs in per_source.items():
            acc = np.concatenate(accs)
            tau = [float(np.mean(1 + np.minimum(acc, k))) if len(acc) else 0.0 for k in ks]
            out[source] = {"tau": [round(t, 4) for t in tau],
                           "tau_block_start": [round(block_start_tau(accs, k), 4) for k in ks],
                           "anchors": int(len(acc))}
        return out


def block_start_tau(walks: list[np.ndarray], k: int, instead: list[np.ndarray] | None = None) -> float:
    """tau(K) over the anchors a greedy engine visits: start at each answer's first position, then jump past every
    accepted run and its bonus token.  Block starts follow rejections more often than an average position does,
    so this reads lower than the every-anchor mean (and matches the engine's tau to ~2%, docs/results/training.md).
    `instead[s][i] >= 0`: the drafts accepted at that anchor from another source that replaces the drafter's there
    (prompt lookup, `lookup_accepted`)."""
    steps = []
    for s, accepted in enumerate(walks):  # accepted[i]: drafts accepted at the i-th answer position
        i = 0
        while i < len(accepted):
            other = -1 if instead is None else int(instead[s][i])
            n = min(int(accepted[i]) if other < 0 else other, k)
            steps.append(1 + n)
            i += 1 + n
    return float(np.mean(steps)) if steps else 0.0


def lookup_accepted(tokens, prompt_len: int, num_anchors: int, k: int, min_match: int) -> np.ndarray:
    """Per answer position (anchor), the drafts prompt lookup would get accepted there as the engine uses it
    (EngineConfig.lookup_min_match: K tokens after a repeated n-gram of >= min_match), or -1 where it proposes none."""
    from specjax.spec.lookup import LookupIndex

    tokens = [int(t) for t in tokens]
    index, out = LookupIndex(min_match), np.full(num_anchors, -1)
    for i in range(num_anchors):
        anchor = prompt_len + i  # the bonus token's position: the context is tokens[:anchor + 1]
        index.extend(tokens[:prompt_len], tokens[prompt_len:anchor + 1])
        proposal = index.propose(k)
        if len(proposal) == k:
            out[i] = leading_matches(proposal, tokens[anchor + 1:anchor + 1 + k])
    return out


def leading_matches(drafts, truth) -> int:
    """How many leading drafts equal the target's tokens `truth` (what greedy verification accepts; a truth cut
    short by the answer's end accepts everything it has)."""
    return next((j for j, (a, b) in enumerate(zip(drafts, truth)) if a != b), min(len(drafts), len(truth)))
