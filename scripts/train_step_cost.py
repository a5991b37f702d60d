"""Seconds per DFlash training step (loss + gradient + AdamW) and per 1k supervised labels, for one recipe.

Runs against whichever `specjax` is importable, so the same batches can be timed on an older checkout
(PYTHONPATH=OLD/src python scripts/train_step_cost.py ...): the draft vocabulary and slot embeddings are used
only where that version has them.  Prints one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="token store")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--num-anchors", type=int, default=256)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="0 = the whole vocabulary")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    args = p.parse_args()

    from specjax.drafter.loader import drafter_config_for
    from specjax.model.loader import load_model
    from specjax.train.store import TokenStore
    from specjax.train.trainer import (
        DFlashMethod,
        SequenceBatches,
        TrainConfig,
        batch_features,
        make_optimizer,
        train_step,
    )

    target = load_model(None)
    store = TokenStore(args.data)
    cfg = TrainConfig(block_size=args.block_size, batch_size=args.batch_size, num_anchors=args.num_anchors,
                      max_len=args.max_len, steps=1000)
    kw = {}
    method_kw = {}
    new = "draft_ids" in inspect.signature(DFlashMethod).parameters
    if new and 0 < args.draft_vocab_size < target.config.vocab_size:
        from specjax.cli.train import draft_vocabulary

        ids, _ = draft_vocabulary(store, target.config.vocab_size, args.draft_vocab_size)
        kw["draft_vocab_size"] = len(ids)
        method_kw["draft_ids"] = tuple(int(i) for i in ids)
    dcfg = drafter_config_for(target.config, num_layers=args.layers, block_size=args.block_size, num_taps=5,
                              mask_token_id=16, **kw)
    method = DFlashMethod(dcfg, args.block_size, args.num_anchors, cfg.decay, **method_kw)
    batches = SequenceBatches(store, cfg)
    optimizer, _ = make_optimizer(cfg)
    params = method.init_params(jax.random.PRNGKey(0), target)
    opt_state = optimizer.init(params)
    consts = method.constants(target)
    times, labels = [], []
    for step in range(args.steps + 2):
        tokens, mask, lengths, _, idx = batches.batch(step)
        extra = method.host_inputs((0, step), tokens, mask, lengths)
        taps = batch_features(target, tokens, idx, method.tap_indices)
        taps.block_until_ready()
        t0 = time.perf_counter()
        params, opt_state, loss, aux, _ = train_step(params, opt_state, consts, jnp.asarray(tokens), taps,
                                                     jnp.asarray(mask), jnp.asarray(lengths), extra, jnp.float32(1.0),
                                                     method=method,
                                                     optimizer=optimizer)
        loss.block_until_ready()
        if step >= 2:
            times.append(time.perf_counter() - t0)
            labels.append(float(aux["num_labels"]))
    sec = statistics.median(times)
    print(json.dumps({"block_size": args.block_size, "batch_size": args.batch_size, "num_anchors": args.num_anchors,
                      "draft_vocab_size": kw.get("draft_vocab_size", 0), "new_code": new, "median_step_s": sec,
                      "labels_per_step": float(np.median(labels)),
                      "s_per_1k_labels": 1000 * sum(times) / sum(labels), "steps": len(times)}))


if __name__ == "__main__":
    main()
