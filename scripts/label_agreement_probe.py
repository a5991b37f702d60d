"""How often a target's teacher-forced argmax differs from a token store's answers (the drafter's labels).

One forward per stored sequence (no KV cache: the training features' path), the argmax at every answer position
against the stored next token, and the median top-1 / top-2 logit gap where they differ.  Run on a store the
target wrote itself, it measures how far that forward is from the engine's decoding (a float16 KV cache, int8
activations); on a store another forward wrote, how many labels that target would not write.

  python scripts/label_agreement_probe.py --store data/heldout-smollm2 --activations int8 --num 60
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--num", type=int, default=60, help="sequences, drawn at random (seed 0)")
    p.add_argument("--activations", default="int8", choices=["int8", "float32", "xla"],
                   help="the GGUF on the CPU kernels with these activations, or XLA's float32 forward")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from specjax.model import target as tgt
    from specjax.model.loader import load_model
    from specjax.train.store import TokenStore

    store = TokenStore(args.store)
    picked = sorted(np.random.default_rng(0).choice(len(store), size=min(args.num, len(store)), replace=False))
    model = (load_model(None) if args.activations == "xla"
             else load_model(None, quant_kernels=True, activations=args.activations))
    cfg = model.config

    @jax.jit
    def top2(weights, tokens):
        s = tokens.shape[1]
        kv = tgt.init_kv_pages(cfg.num_layers, 1, 1, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
        batch = tgt.ForwardBatch(tokens, jnp.arange(s)[None], jnp.zeros((1, s), jnp.int32),
                                 jnp.zeros((1, 1), jnp.int32))
        hidden, _, _ = tgt.forward(weights, kv, batch, cfg, ())
        return jax.lax.top_k(tgt.logits(weights, hidden), 2)

    all_tokens = store.tokens()
    differ = total = 0
    gaps = []
    t0 = time.time()
    for i in picked:
        rec = store.index[i]
        n, start = min(rec["length"], 512), rec["prompt_len"]
        seq = np.asarray(all_tokens[rec["offset"]:rec["offset"] + n], np.int32)
        padded = np.zeros((1, -(-n // 64) * 64), np.int32)
        padded[0, :n] = seq
        values, ids = (np.asarray(a)[0] for a in top2(model.weights, jnp.asarray(padded)))
        wrong = ids[start - 1:n - 1, 0] != seq[start:n]
        differ += int(wrong.sum())
        total += int(len(wrong))
        gaps += list((values[start - 1:n - 1, 0] - values[start - 1:n - 1, 1])[wrong])
    print(json.dumps({"store": args.store, "activations": args.activations, "sequences": len(picked),
                      "answer_tokens": total, "differ": differ, "share": round(differ / max(total, 1), 4),
                      "median_top2_gap_where_differ": round(float(np.median(gaps)), 4) if gaps else None,
                      "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
