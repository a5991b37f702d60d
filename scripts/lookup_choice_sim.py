"""Which block to verify, the drafter's or prompt lookup's: rules compared by simulation on target answers.

For every answer position of the held-out store (data/heldout-smollm2, tuning) and of a bench run's plain-decoding
outputs (testing), the drafter's block (teacher-forced, the served int8 taps), its per-slot probabilities, prompt
lookup's proposal with its match length, and the drafter's probabilities of lookup's tokens.  Each rule picks one
block per step; its tau is the block-start walk's (what the engine measures, training.md session 52).

  python scripts/lookup_choice_sim.py --bench docs/results/bench-session52-lookup/bench.json [--k 3] [--cyclic] \
      [--out F]

(--cyclic: a copy that runs into the context's end goes on with its own period, as `spec.lookup.copy_after` does
now; without it the proposal stops there, as before session 53.)
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import numpy as np


def lookup_match(tokens: list[int], upto: int, k: int, max_n: int = 8, cyclic: bool = False):
    """(match length n, up to k proposed tokens) for context tokens[:upto] (the longest suffix n-gram's latest
    earlier occurrence, as spec/lookup.py), or (0, [])."""
    ctx = tokens[:upto]
    last = len(ctx) - 1
    for n in range(min(max_n, last), 0, -1):
        suffix = ctx[last + 1 - n:]
        for end in range(last - 1, n - 2, -1):  # latest occurrence ending before the suffix's last token
            if ctx[end + 1 - n:end + 1] == suffix:
                prop = ctx[end + 1:end + 1 + k]
                while cyclic and len(prop) < k:  # the copy runs into the suffix: continue it from itself
                    prop.append(prop[len(prop) - (last - end)])
                return n, prop
    return 0, []


def collect(target, served, method, params, consts, store, k: int, cyclic: bool = False):
    """Per sequence: dict of per-anchor arrays (drafter accepted, max probs, lookup n / accepted / drafter probs)."""
    from specjax.train.objective import block_logits
    from specjax.train.simtau import HeldOutSet

    embed, head, t2d, _ = consts
    held = HeldOutSet(served, store, method.tap_indices, method.sim_span, max_len=2048)
    seqs = list(store.sequences())

    @jax.jit
    def probs_fn(params, tokens, taps, anchors, keep):
        logits = block_logits(params, method.dcfg, embed, head, tokens, method.split_taps(taps)[0], anchors, keep,
                              method.sim_span)[:, :, :k]
        return jax.nn.softmax(logits, -1)

    out = []
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
            truth_d = np.full((n_anchor, k), -2)
            look_n = np.zeros(n_anchor, np.int32)
            look_acc = np.full(n_anchor, -1)
            look_q = np.zeros((n_anchor, k))
            t2d_ = np.asarray(t2d)
            dacc = np.zeros(n_anchor, np.int32)
            for i in range(n_anchor):
                a = pl + i
                truth = toks[a + 1:a + 1 + k]
                td = [int(t2d_[t]) for t in truth]
                truth_d[i, :len(td)] = td
                hit = [int(draft[i, s]) == td[s] for s in range(len(td))]
                dacc[i] = next((s for s, h in enumerate(hit) if not h), len(hit))
                n, prop = lookup_match(toks, a + 1, k, cyclic=cyclic)
                look_n[i] = n
                if n and len(prop) == k:
                    look_acc[i] = next((s for s, (x, y) in enumerate(zip(prop, truth)) if x != y), min(k, len(truth)))
                    look_q[i] = [p[i, s, t2d_[t]] if t2d_[t] >= 0 else 0.0 for s, t in enumerate(prop)]
            out.append({"source": held.sources[j], "dacc": dacc, "maxp": maxp, "look_n": look_n,
                        "look_acc": look_acc, "look_q": look_q})
    return out


def walk_tau(seqs, choose, k: int) -> dict:
    """Block-start tau per source and over all, when `choose(seq, i)` says lookup (True) or the drafter."""
    steps = {}
    for s in seqs:
        i = 0
        while i < len(s["dacc"]):
            use = s["look_acc"][i] >= 0 and choose(s, i)
            n = min(int(s["look_acc"][i] if use else s["dacc"][i]), k)
            steps.setdefault(s["source"], []).append((1 + n, use))
            steps.setdefault("all", []).append((1 + n, use))
            i += 1 + n
    return {src: (round(float(np.mean([a for a, _ in v])), 4), round(float(np.mean([u for _, u in v])), 3))
            for src, v in steps.items()}


def expected(q) -> float:
    """Expected accepted drafts of a block whose slots are right with probabilities q (independently)."""
    return float(np.cumprod(q).sum())


def rules(k: int) -> dict:
    r = {"drafter": lambda s, i: False,
         "oracle": lambda s, i: s["look_acc"][i] > min(s["dacc"][i], k)}
    for m in (1, 2, 3, 4, 5, 6):
        r[f"n>={m}"] = (lambda m: lambda s, i: s["look_n"][i] >= m)(m)
    # lookup when its tokens' expected acceptance (under a prior of lookup being right, mixed with the drafter's own
    # probabilities of those tokens) beats the drafter's expected acceptance from its max probabilities
    for m in (1, 2, 3):
        for prior in (0.3, 0.5, 0.7, 0.8, 0.9):
            def f(s, i, m=m, prior=prior):
                if s["look_n"][i] < m:
                    return False
                q = 1 - (1 - prior) * (1 - s["look_q"][i])
                return expected(q) > expected(s["maxp"][i])
            r[f"mix n>={m} prior={prior}"] = f
    for m in (1, 2, 3, 4):
        for t in (0.3, 0.5, 0.7, 0.9):
            r[f"n>={m} & p1<{t}"] = (lambda m, t: lambda s, i: s["look_n"][i] >= m and s["maxp"][i][0] < t)(m, t)
            r[f"n>={m} & E<{t * k:.1f}"] = (lambda m, t: lambda s, i: s["look_n"][i] >= m
                                            and expected(s["maxp"][i]) < t * k)(m, t)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="bench.json whose ar outputs are the test answers")
    p.add_argument("--drafter", default="src/specjax/assets/drafters/smollm2-135m-instruct-dflash")
    p.add_argument("--heldout", default="data/heldout-smollm2")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--cyclic", action="store_true", help="a copy that runs into the suffix continues from itself")
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

    sets = {"heldout": collect(target, served, method, params, consts, TokenStore(args.heldout), args.k)}
    with tempfile.TemporaryDirectory() as tmp:
        store = TokenStore(tmp, target.config.vocab_size)
        for r in bench["records"]:
            if r["method"] == "ar" and r["dataset"] != "mt_bench":
                prompts = load_eval(r["dataset"])[:r["num_requests"]]
                for prompt, out in zip(prompts, r["outputs"]):
                    ids_ = target.tokenizer.encode_chat([{"role": "user", "content": prompt.turns[0]}])
                    store.append(prompt.id, r["dataset"], ids_ + list(out), len(ids_), "length")
        sets["bench"] = collect(target, served, method, params, consts, store, args.k, args.cyclic)
    result = {name: {rule: walk_tau(seqs, f, args.k) for rule, f in rules(args.k).items()}
              for name, seqs in sets.items()}
    for rule in rules(args.k):
        print(f"{rule:28s} heldout {result['heldout'][rule]['all']}  bench {result['bench'][rule]['all']}")
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
