"""Simulated tau of a DFlash drafter with draft vocabularies it was not trained with: no training is needed, the
draft head being rows of the frozen target head.

For each held-out answer (a token store, or the plain-decoding outputs of a `specjax bench` run), the block-start
tau at K = block - 1 with: the drafter's own vocabulary; that vocabulary grown by the store's next most frequent
answer tokens (`--sizes`, 0 = the whole vocabulary); and the engine's context vocabulary (spec/context_vocab.py:
each sequence's last N distinct prompt tokens outside the vocabulary, `--context N`, padded to N with tokens no
stored answer holds so that one shape compiles).  The taps are the target's as inference runs it (the GGUF on the
int8 kernels).  Prints one JSON line per setting, with slot 1's hit rate over every anchor by where its label lies
(in the draft vocabulary, in the prompt outside it, neither).

  python scripts/context_vocab_sim.py --heldout data/heldout-smollm2 --sizes 16384,0 --context 4,8,16,32
  python scripts/context_vocab_sim.py --bench docs/results/bench/bench.json --context 32
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

DRAFTER = "src/specjax/assets/drafters/smollm2-135m-instruct-dflash"


def bench_store(bench_path: str, target, out: str):
    """A token store of a bench run's plain-decoding answers (single-turn datasets)."""
    from specjax.datasets import load_eval
    from specjax.train.store import TokenStore

    bench = json.load(open(bench_path))
    store = TokenStore(out, target.config.vocab_size)
    for dataset in ("gsm8k", "math500", "humaneval", "mbpp"):
        ar = [r for r in bench["records"] if r["method"] == "ar" and r["dataset"] == dataset]
        if not ar:
            continue
        for prompt, answer in zip(load_eval(dataset)[:ar[0]["num_requests"]], ar[0]["outputs"]):
            ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt.turns[0]}])
            store.append(prompt.id, dataset, ids + list(answer), len(ids), "length")
    return store


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--heldout", help="token store of target answers")
    src.add_argument("--bench", help="bench.json of a `specjax bench` run with an ar row")
    p.add_argument("--drafter", default=DRAFTER)
    p.add_argument("--store", default="data/regen-smollm2", help="answers whose token counts grow the vocabulary")
    p.add_argument("--sizes", default="", help="vocabulary sizes to try (0 = all)")
    p.add_argument("--context", default="32", help="context-vocabulary sizes to try (0 = none)")
    args = p.parse_args()

    from specjax.drafter.loader import load_drafter
    from specjax.model.loader import load_model
    from specjax.spec.context_vocab import context_ids
    from specjax.train.simtau import HeldOutSet, _simulate, block_start_tau
    from specjax.train.store import TokenStore
    from specjax.train.trainer import DFlashMethod

    target = load_model(None)  # float32: the frozen embedding and head
    served = load_model(None, quant_kernels=True, activations="int8")  # the taps inference reads
    dcfg, w = load_drafter(args.drafter, target.config)
    base = np.asarray(w.draft_ids)
    draftable = np.zeros(target.config.vocab_size, bool)
    draftable[base] = True
    tmp = tempfile.TemporaryDirectory()
    held_store = TokenStore(args.heldout) if args.heldout else bench_store(args.bench, target, tmp.name)
    seqs = list(held_store.sequences())
    own = DFlashMethod(dcfg, dcfg.block_size, 1, 4.0, draft_ids=tuple(int(i) for i in base))
    params = own.load(args.drafter, target.config)
    held = HeldOutSet(served, held_store, own.tap_indices, own.sim_span, max_len=2048, rows=1)
    k = dcfg.block_size - 1

    def report(name, ids_of):
        walks, sources = [], []
        slot1 = {"draft vocabulary": [0, 0], "prompt outside it": [0, 0], "neither": [0, 0]}  # [hits, anchors]
        outside: dict[str, list[bool]] = {}  # per source: is slot 1's label outside the draft vocabulary?
        for c, arrays in enumerate(held.chunks):
            rec, toks = seqs[held.indices[c]]
            ids = ids_of(rec, toks)
            method = DFlashMethod(dcfg, dcfg.block_size, 1, 4.0, draft_ids=ids)
            accepted, counted = (np.asarray(a)[0] for a in _simulate(params, method.constants(target), *arrays,
                                                                     method=own))
            walks.append(accepted[counted])
            sources.append(rec["source"])
            prompt = set(int(t) for t in toks[:rec["prompt_len"]])
            for a, n in zip(np.asarray(arrays[4])[0][counted], accepted[counted]):  # slot 1's label: toks[a + 1]
                label = int(toks[a + 1])
                kind = ("draft vocabulary" if draftable[label] else
                        "prompt outside it" if label in prompt else "neither")
                slot1[kind][0] += int(n >= 1)
                slot1[kind][1] += 1
                outside.setdefault(rec["source"], []).append(not draftable[label])
        out = {"setting": name, "k": k}
        for s in sorted(set(sources)) + ["all"]:
            out[s] = round(block_start_tau([a for a, t in zip(walks, sources) if s in ("all", t)], k), 4)
        anchors = sum(v[1] for v in slot1.values())
        out["slot1_by_label"] = {kind: {"share": round(v[1] / anchors, 4), "hit": round(v[0] / max(v[1], 1), 3)}
                                 for kind, v in slot1.items()}
        out["labels_outside_draft_vocabulary"] = {src: round(float(np.mean(v)), 4) for src, v in outside.items()}
        print(json.dumps(out), flush=True)

    report("draft vocabulary", lambda rec, toks: tuple(int(i) for i in base))
    store = TokenStore(args.store)
    counts = np.zeros(target.config.vocab_size, np.int64)
    tokens = store.tokens()
    for rec in store.index:
        np.add.at(counts, tokens[rec["offset"] + rec["prompt_len"]:rec["offset"] + rec["length"]].astype(np.int64), 1)
    order = [int(i) for i in np.argsort(-counts, kind="stable") if not draftable[i]]
    for size in (int(s) for s in args.sizes.split(",") if s):
        grown = None if size == 0 else tuple(sorted(int(i) for i in np.concatenate([base, order[:size - len(base)]])))
        report(f"vocabulary of {size or 'all'} tokens", lambda rec, toks, g=grown: g)
    unused = [i for i in order[::-1] if counts[i] == 0]  # padding: tokens no stored answer holds
    for n in (int(s) for s in args.context.split(",") if s):
        def with_context(rec, toks, n=n):  # padded to one size (one compiled shape) with never-written tokens
            extra = [int(t) for t in context_ids(toks[:rec["prompt_len"]], draftable, n) if t >= 0]
            pad = [i for i in unused[:2 * n] if i not in set(toks.tolist())][:n - len(extra)]
            return tuple(sorted(int(i) for i in np.concatenate([base, extra, pad])))
        report(f"draft vocabulary + context vocabulary of {n}", with_context)


if __name__ == "__main__":
    main()
