"""Which block to verify, the drafter's or prompt lookup's: rules compared by simulation on target answers.

For every answer position of the held-out store (data/heldout-smollm2, tuning) and of a bench run's plain-decoding
outputs (testing), the drafter's block (teacher-forced, the served int8 taps), its per-slot probabilities, prompt
lookup's proposal with its match length, and the drafter's probabilities of lookup's tokens.  Each rule picks one
block per step; its tau is the block-start walk's (what the engine measures, training.md session 52).

  python scripts/lookup_choice_sim.py --bench docs/results/bench-session52-lookup/bench.json [--k 3] [--cyclic] \
      [--store data/regen-smollm2] [--long-lookup 5,7] [--out F]

(--cyclic: a copy that runs into the context's end goes on with its own period, as `spec.lookup.copy_after` does
now; without it the proposal stops there, as before session 53.)
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import numpy as np


class StoreIndex:
    """Every n-gram (n in ns) of a token store's sequences, as sorted 64-bit rolling hashes with their end positions:
    the continuations of a context's suffix n-gram across the whole store (retrieval drafting, as REST)."""

    SEP = 65535  # between sequences: no n-gram or continuation of a real context contains it

    def __init__(self, store, ns=(2, 3, 4, 5, 6, 7, 8)):
        parts = []
        for _, toks in store.sequences():
            parts += [np.asarray(toks, np.uint64), np.full(8, self.SEP, np.uint64)]
        self.t = np.concatenate(parts)
        self.ns, self.sorted, self.ends = ns, {}, {}
        h = self.t.copy()
        with np.errstate(over="ignore"):
            for n in range(2, max(ns) + 1):
                nh = np.full_like(h, np.uint64(2 ** 64 - 1))
                nh[n - 1:] = h[n - 2:-1] * np.uint64(1000003) + self.t[n - 1:]
                h = nh
                if n in ns:
                    order = np.argsort(h, kind="stable")
                    self.sorted[n], self.ends[n] = h[order], order
        self.t = self.t.astype(np.int64)

    def hash(self, ctx):
        h = np.uint64(ctx[0])
        with np.errstate(over="ignore"):
            for x in ctx[1:]:
                h = h * np.uint64(1000003) + np.uint64(x)
        return h

    def query(self, ctx: list[int], k: int):
        """(n, occurrences, most frequent k-token continuation, its share) of the longest suffix n-gram found."""
        assert k <= 8, k
        for n in sorted(self.ns, reverse=True):
            if len(ctx) < n:
                continue
            h = self.hash(ctx[-n:])
            lo, hi = np.searchsorted(self.sorted[n], h, "left"), np.searchsorted(self.sorted[n], h, "right")
            if hi == lo:
                continue
            ends = self.ends[n][lo:hi][-4096:]
            cont = self.t[ends[:, None] + 1 + np.arange(k)[None, :]]  # k <= 8: inside the separator padding
            cont = cont[(cont != self.SEP).all(1)]
            if not len(cont):
                continue
            rows, counts = np.unique(cont, axis=0, return_counts=True)
            best = int(counts.argmax())
            return n, int(hi - lo), [int(x) for x in rows[best]], float(counts[best] / counts.sum())
        return 0, 0, [], 0.0


def collect(served, method, params, consts, store, k: int, cyclic: bool = False, index=None, long_ks=()):
    """Per sequence: dict of per-anchor arrays (drafter accepted, max probs, lookup n / accepted / drafter probs)."""
    from specjax.spec.lookup import LookupIndex, copy_after
    from specjax.train.objective import block_logits
    from specjax.train.simtau import HeldOutSet, leading_matches

    embed, head, t2d, *_ = consts
    held = HeldOutSet(served, store, method.tap_indices, method.sim_span, max_len=2048)
    seqs = list(store.sequences())

    @jax.jit
    def probs_fn(params, tokens, taps, anchors, keep):
        logits = block_logits(params, method.dcfg, embed, head, tokens, method.split_taps(taps)[0], anchors, keep,
                              method.sim_span)[:, :, :k]
        return jax.nn.softmax(logits, -1)

    out, t2d_ = [], np.asarray(t2d)
    for c, (tokens, taps, mask, lengths, anchors, keep) in enumerate(held.chunks):
        probs = np.asarray(probs_fn(params, tokens, taps, anchors, keep))  # [R, N, k, Vd]
        rows = probs.shape[0]
        for r in range(rows):
            j = c * rows + r
            if held.sources[j] is None:
                continue
            rec, toks = seqs[held.indices[j]]
            toks = [int(t) for t in toks]
            pl = rec["prompt_len"]
            n_anchor = int(np.asarray(keep[r]).sum())
            p = probs[r, :n_anchor]  # [n, k, Vd]
            draft = p.argmax(-1)
            maxp = p.max(-1)
            look_n = np.zeros(n_anchor, np.int32)
            look_acc = np.full(n_anchor, -1)
            look_q = np.zeros((n_anchor, k))
            dacc = np.zeros(n_anchor, np.int32)
            long = {kk: np.full(n_anchor, -1) for kk in long_ks}  # lookup's accepted drafts at a larger K
            st = {"store_n": np.zeros(n_anchor, np.int32), "store_cnt": np.zeros(n_anchor, np.int32),
                  "store_share": np.zeros(n_anchor), "store_acc": np.full(n_anchor, -1)}
            lookup = LookupIndex(1)  # every match length, so that rules can pick their minimum
            for i in range(n_anchor):
                a = pl + i
                truth = toks[a + 1:a + 1 + k]
                dacc[i] = leading_matches(draft[i], [int(t2d_[t]) for t in truth])
                lookup.extend(toks[:pl], toks[pl:a + 1])
                n, end = lookup.match()
                look_n[i] = n
                for kk in (k, *long_ks) if n else ():
                    prop = copy_after(lookup.tokens, end + 1, kk) if cyclic else lookup.tokens[end + 1:end + 1 + kk]
                    if len(prop) < kk:
                        continue
                    if kk == k:
                        look_acc[i] = leading_matches(prop, truth)
                        look_q[i] = [p[i, s, t2d_[t]] if t2d_[t] >= 0 else 0.0 for s, t in enumerate(prop)]
                    else:
                        long[kk][i] = leading_matches(prop, toks[a + 1:a + 1 + kk])
                if index is not None:
                    n, cnt, prop, share = index.query(toks[:a + 1], k)
                    if n:
                        st["store_n"][i], st["store_cnt"][i], st["store_share"][i] = n, cnt, share
                        st["store_acc"][i] = leading_matches(prop, truth)
            out.append({"source": held.sources[j], "dacc": dacc, "maxp": maxp, "look_n": look_n,
                        "look_acc": look_acc, "look_q": look_q, "long": long, **st})
    return out


def walk_tau(seqs, choose, k: int) -> dict:
    """Block-start tau per source and over all, and the share of steps not drafted by the drafter, when
    `choose(seq, i)` names the block verified at anchor i: True / "look_acc" (prompt lookup), "store_acc" (the store's
    continuation) or False / "dacc" (the drafter; also wherever the named source proposes nothing)."""
    steps = {}
    for s in seqs:
        i = 0
        while i < len(s["dacc"]):
            key = choose(s, i)
            key = {True: "look_acc", False: "dacc"}.get(key, key)
            if s[key][i] < 0:
                key = "dacc"
            n = min(int(s[key][i]), k)
            for src in (s["source"], "all"):
                steps.setdefault(src, []).append((1 + n, key != "dacc"))
            i += 1 + n
    return {src: (round(float(np.mean([a for a, _ in v])), 4), round(float(np.mean([u for _, u in v])), 3))
            for src, v in steps.items()}


def long_lookup_rate(seqs, kl: int, k: int, curve: dict, draft_cost: float, host_cost: float,
                     min_match: int = 4) -> dict:
    """Tokens per plain-step time, per source, when lookup's steps (match >= min_match) verify kl drafts and skip
    the drafter, the drafter's verify k: a round costs t(q) / t(1) from `curve` (interpolated) plus `host_cost`,
    plus `draft_cost` where the drafter ran (both in plain steps)."""
    qs = sorted(curve)
    t = lambda q: float(np.interp(q, qs, [curve[x] for x in qs]))  # noqa: E731
    tokens, cost = {}, {}
    for s in seqs:
        acc = s["long"][kl] if kl != k else s["look_acc"]
        i = 0
        while i < len(s["dacc"]):
            look = s["look_n"][i] >= min_match and acc[i] >= 0
            n = min(int(acc[i]), kl) if look else min(int(s["dacc"][i]), k)
            c = t((kl if look else k) + 1) + host_cost + (0.0 if look else draft_cost)
            for src in (s["source"], "all"):
                tokens[src], cost[src] = tokens.get(src, 0) + 1 + n, cost.get(src, 0.0) + c
            i += 1 + n
    return {src: round(tokens[src] / cost[src], 3) for src in tokens}


def expected(q) -> float:
    """Expected accepted drafts of a block whose slots are right with probabilities q (independently)."""
    return float(np.cumprod(q).sum())


def rules(k: int, with_store: bool) -> dict:
    r = {"drafter": lambda s, i: False,
         "oracle": lambda s, i: s["look_acc"][i] > min(s["dacc"][i], k)}
    for m in (3, 4, 5):
        r[f"n>={m}"] = (lambda m: lambda s, i: s["look_n"][i] >= m)(m)
    # lookup when its tokens' expected acceptance (under a prior of lookup being right, mixed with the drafter's own
    # probabilities of those tokens) beats the drafter's expected acceptance from its max probabilities
    for m in (2, 3):
        for prior in (0.5, 0.7, 0.8):
            def f(s, i, m=m, prior=prior):
                if s["look_n"][i] < m:
                    return False
                q = 1 - (1 - prior) * (1 - s["look_q"][i])
                return expected(q) > expected(s["maxp"][i])
            r[f"mix n>={m} prior={prior}"] = f
    for m in (3, 4):
        for t in (0.5, 0.7, 0.9):
            r[f"n>={m} & E<{t * k:.1f}"] = (lambda m, t: lambda s, i: s["look_n"][i] >= m
                                            and expected(s["maxp"][i]) < t * k)(m, t)
    if with_store:
        r["oracle3"] = lambda s, i: max(("dacc", "look_acc", "store_acc"), key=lambda key: min(s[key][i], k))
        r["oracle store"] = lambda s, i: "store_acc" if s["store_acc"][i] > min(s["dacc"][i], k) else "dacc"
        for m in (4, 5, 6, 8):
            for c in (1, 3, 10):
                for share in (0.0, 0.5, 0.8):
                    def g(s, i, m=m, c=c, share=share):
                        if s["look_n"][i] >= 4:
                            return "look_acc"
                        ok = s["store_n"][i] >= m and s["store_cnt"][i] >= c and s["store_share"][i] >= share
                        return "store_acc" if ok else "dacc"
                    r[f"n>=4 | store n>={m} cnt>={c} share>={share}"] = g
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="bench.json whose ar outputs are the test answers")
    p.add_argument("--drafter", default="src/specjax/assets/drafters/smollm2-135m-instruct-dflash")
    p.add_argument("--heldout", default="data/heldout-smollm2")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--cyclic", action="store_true", help="a copy that runs into the suffix continues from itself")
    p.add_argument("--store", default=None, help="also retrieval drafts from this token store's n-grams")
    p.add_argument("--long-lookup", default="", help="also lookup's steps at these larger K, e.g. 5,7 (rates by "
                   "--verify-curve q:t(q)/t(1),..., --drafter-cost and --host-cost in plain steps)")
    p.add_argument("--verify-curve", default="1:1,2:1.12,4:1.39,8:2.33", help="default: kflat.md, session 53")
    p.add_argument("--drafter-cost", type=float, default=0.19, help="0.9 ms of a 4.7 ms plain step (session 53)")
    p.add_argument("--host-cost", type=float, default=0.074, help="a round's host work over a plain step's")
    args = p.parse_args()

    from specjax.datasets import load_eval
    from specjax.drafter.loader import load_drafter
    from specjax.model.loader import load_model
    from specjax.train.store import TokenStore
    from specjax.train.trainer import DFlashMethod

    bench = json.load(open(args.bench))
    config = bench["config"]
    target = load_model(config.get("model"))
    served = load_model(config.get("model"), quant_kernels=True, activations=config["kernel_activations"])
    dcfg, w = load_drafter(args.drafter, target.config)
    ids = tuple(int(i) for i in np.asarray(w.draft_ids))
    method = DFlashMethod(dcfg, dcfg.block_size, 1, 4.0, draft_ids=ids)
    params, consts = method.load(args.drafter, target.config), method.constants(target)

    index = None if args.store is None else StoreIndex(TokenStore(args.store))
    long_ks = tuple(int(x) for x in args.long_lookup.split(",") if x)
    sets = {"heldout": collect(served, method, params, consts, TokenStore(args.heldout), args.k, args.cyclic,
                               index, long_ks)}
    with tempfile.TemporaryDirectory() as tmp:
        store = TokenStore(tmp, target.config.vocab_size)
        for r in bench["records"]:
            if r["method"] == "ar" and r["dataset"] != "mt_bench":
                prompts = load_eval(r["dataset"])[:r["num_requests"]]
                for prompt, out in zip(prompts, r["outputs"]):
                    ids_ = target.tokenizer.encode_chat([{"role": "user", "content": prompt.turns[0]}])
                    store.append(prompt.id, r["dataset"], ids_ + list(out), len(ids_), "length")
        sets["bench"] = collect(served, method, params, consts, store, args.k, args.cyclic, index, long_ks)
    table = rules(args.k, index is not None)
    result = {name: {rule: walk_tau(seqs, f, args.k) for rule, f in table.items()} for name, seqs in sets.items()}
    for rule in table:
        print(f"{rule:28s} heldout {result['heldout'][rule]['all']}  bench {result['bench'][rule]['all']}")
    if long_ks:
        curve = {float(q): float(v) for q, v in (x.split(":") for x in args.verify_curve.split(","))}
        for name, seqs in sets.items():
            result[name]["long_lookup"] = {kl: long_lookup_rate(seqs, kl, args.k, curve, args.drafter_cost,
                                                                args.host_cost) for kl in (args.k, *long_ks)}
            print(name, "tokens per plain-step time, lookup at K =", result[name]["long_lookup"])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
