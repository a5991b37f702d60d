"""Probe what a trained DFlash drafter uses: per-slot training accuracy with the real target taps, with zeroed
taps and with another sequence's taps, against a bigram baseline (x[a+1] from the anchor token x[a] alone).

    python scripts/probe_dflash_context.py --data runs/regen-smollm2 --features runs/features-smollm2

A drafter that has learned the task beats the bigram on slot 1 (it has the anchor token AND the context); one
that only uses the context stays below it, with slot 1 no better than later slots.
"""

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafter.loader import load_drafter
from specjax.llm import default_drafter_path
from specjax.model.loader import load_model
from specjax.train.features import FeatureCache
from specjax.train.objective import dflash_loss, sample_anchors
from specjax.train.store import TokenStore
from specjax.train.trainer import SequenceBatches, TrainConfig, batch_features


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model (default: the embedded SmolLM2)")
    p.add_argument("--drafter", default=None, help="DFlash drafter dir (default: the shipped one)")
    p.add_argument("--data", required=True, help="token store (specjax regenerate)")
    p.add_argument("--features", default=None, help="feature cache (specjax cache-features); default: online")
    p.add_argument("--batches", type=int, default=12)
    args = p.parse_args()

    target = load_model(args.target)
    dcfg, w = load_drafter(args.drafter or default_drafter_path(), target.config)
    store = TokenStore(args.data)
    cache = FeatureCache(args.features) if args.features else None
    batches = SequenceBatches(store, TrainConfig(batch_size=4, num_anchors=32, seed=123))
    q = dcfg.block_size
    loss_fn = jax.jit(lambda tok, taps, m, n, a, k: dflash_loss(
        w, dcfg, target.weights.embed, target.weights.output_head, tok, taps, m, n, a, k, q, 7.0))
    bigram: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for rec, toks in store.sequences():
        resp = toks[rec["prompt_len"]:]
        for a, b in zip(resp[:-1], resp[1:]):
            bigram[int(a)][int(b)] += 1
    results = collections.defaultdict(list)
    for step in range(1000, 1000 + args.batches):
        tokens, mask, lengths, _, idx = batches.batch(step)
        anchors, keep = sample_anchors(np.random.default_rng(step), mask, lengths, 32, q)
        taps = batch_features(target, tokens, idx, dcfg.hidden_state_indices, cache)
        for name, t in [("real taps", taps), ("zero taps", jnp.zeros_like(taps)),
                        ("other sequence's taps", jnp.roll(taps, 1, axis=0))]:
            loss, aux = loss_fn(jnp.asarray(tokens), t, jnp.asarray(mask), jnp.asarray(lengths), jnp.asarray(anchors),
                                jnp.asarray(keep))
            results[name].append((float(loss), np.asarray(aux["acc_per_slot"])))
        hits = [bool(bigram[int(tokens[i, a])]) and bigram[int(tokens[i, a])].most_common(1)[0][0] == tokens[i, a + 1]
                for i in range(tokens.shape[0]) for a in anchors[i][keep[i]] if a + 1 < lengths[i]]
        results["bigram"].append(np.mean(hits))
    for name in ("real taps", "zero taps", "other sequence's taps"):
        acc = np.mean([r[1] for r in results[name]], axis=0)
        loss = np.mean([r[0] for r in results[name]])
        print(f"{name:22s} loss {loss:.3f}  accuracy slots 1-6 {np.round(acc[:6], 3)}")
    bigram_acc = np.mean(results["bigram"])
    print(f"{'bigram on the anchor':22s} slot-1 accuracy {bigram_acc:.3f} (statistics of the whole store)")


if __name__ == "__main__":
    main()
