"""Simulated tau (teacher-forced, every anchor) against the engine's tau from a `specjax bench` run, same prompts.

The bench's plain-decoding outputs are the target's greedy answers to the bench prompts.  Simulated on those
answers with the same drafter, the every-anchor tau reads high (block starts follow rejections more often than an
average position does); the block-start tau (the anchors the engine visits) should match the engine's tau of
`dflash@K`: a gap there would be a mismatch between the engine's drafter context and the training features.
Single-turn datasets only.  Prints one JSON line per dataset.  `--method eagle3` does the same for an EAGLE-3
drafter (its training-time-test chain of 7 drafts, against the bench's `eagle3@K` rows).

  python scripts/sim_tau_vs_bench.py --bench docs/results/bench/bench.json --drafter DIR [--method eagle3]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="bench.json of a `specjax bench` run with ar and dflash@K")
    p.add_argument("--drafter", required=True)
    p.add_argument("--method", default="dflash", choices=["dflash", "eagle3"])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--lookup-min-match", type=int, default=0,
                   help="also the block-start tau with prompt lookup's drafts replacing the drafter's as the engine "
                        "does at this minimum match (bench's NAME+lookup rows)")
    args = p.parse_args()

    from specjax.datasets import load_eval
    from specjax.drafter.loader import load_drafter
    from specjax.model.loader import load_model
    from specjax.train.simtau import HeldOutSet, block_start_tau, lookup_accepted
    from specjax.train.store import TokenStore
    from specjax.train.trainer import DFlashMethod, Eagle3Method

    bench = json.load(open(args.bench))
    config = bench["config"]
    target = load_model(config.get("model"))  # float32: the drafter's frozen embedding and head come from it
    # the taps as the bench's engine computed them (a GGUF on the int8-activation kernels, if it ran so)
    served = (load_model(config.get("model"), quant_kernels=True, activations=config["kernel_activations"])
              if config.get("quant_kernels") else target)
    if args.method == "dflash":
        dcfg, w = load_drafter(args.drafter, target.config)
        ids = None if w.draft_ids is None else tuple(int(i) for i in np.asarray(w.draft_ids))
        # the engine drafted with the prompt's tokens beside the draft vocabulary (bench runs before it: 0)
        method = DFlashMethod(dcfg, dcfg.block_size, 1, 4.0, draft_ids=ids,
                              sim_context_vocab=config.get("context_vocab", 0))
    else:
        from specjax.drafter.eagle3_loader import load_eagle3

        ecfg, w = load_eagle3(args.drafter, target.config)
        ids = np.arange(ecfg.draft_vocab_size) + (0 if w.d2t is None else np.asarray(w.d2t))
        method = Eagle3Method(ecfg, tuple(int(i) for i in ids), target.config.num_layers)
    params, consts = method.load(args.drafter, target.config), method.constants(target)
    records = bench["records"]
    for dataset in ("gsm8k", "math500", "humaneval", "mbpp"):
        ar = [r for r in records if r["method"] == "ar" and r["dataset"] == dataset]
        if not ar:
            continue
        prompts = load_eval(dataset, args.data_dir)[:ar[0]["num_requests"]]
        with tempfile.TemporaryDirectory() as tmp:
            store = TokenStore(tmp, target.config.vocab_size)
            for prompt, out in zip(prompts, ar[0]["outputs"]):
                ids_ = target.tokenizer.encode_chat([{"role": "user", "content": prompt.turns[0]}])
                store.append(prompt.id, dataset, ids_ + list(out), len(ids_), "length")
            held = HeldOutSet(served, store, method.tap_indices, method.sim_span, max_len=2048)
            walks = held.accepted_per_anchor(method, params, consts)
            sim = held.evaluate(method, params, consts, walks)[dataset]
            if args.lookup_min_match:
                seqs = list(store.sequences())
                sim["tau_lookup"] = [block_start_tau(walks, k, [
                    lookup_accepted(seqs[i][1], seqs[i][0]["prompt_len"], len(w), k, args.lookup_min_match)
                    for i, w in zip(held.indices, walks)]) for k in range(1, len(sim["tau"]) + 1)]
        engine = {r["num_draft_tokens"]: r["tau"] for r in records
                  if r["method"].partition("@")[0] == args.method and r["dataset"] == dataset}
        with_lookup = {r["num_draft_tokens"]: r["tau"] for r in records
                       if r["method"].partition("@")[0] == args.method + "+lookup" and r["dataset"] == dataset}
        print(json.dumps({"dataset": dataset,
                          "simulated_tau": {k: round(sim["tau"][k - 1], 3) for k in sorted(engine)},
                          "block_start_tau": {k: round(sim["tau_block_start"][k - 1], 3) for k in sorted(engine)},
                          "engine_tau": {k: round(v, 3) for k, v in sorted(engine.items())},
                          **({"block_start_tau_lookup": {k: round(sim["tau_lookup"][k - 1], 3) for k in sorted(engine)},
                              "engine_tau_lookup": {k: round(v, 3) for k, v in sorted(with_lookup.items())}}
                             if args.lookup_min_match else {})}))


if __name__ == "__main__":
    main()
