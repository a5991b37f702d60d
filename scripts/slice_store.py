"""A token store of N consecutive sequences of another, and for a prefix a view of its (possibly still partial)
feature cache.

    python scripts/slice_store.py --store data/regen-smollm2 --features runs/features-smollm2 \
        --num-sequences 2048 --out-store runs/prefix-store --out-features runs/prefix-features
    python scripts/slice_store.py --store data/regen-smollm2 --start 5884 --out-store runs/fresh-store
    python scripts/slice_store.py --store runs/s41-store --drop-drawn DRAFTER/train_config.json \
        --drawn-steps 859 --out-store runs/s42-store
    python scripts/slice_store.py --store runs/s42-store --drop-drawn A/train_config.json --drawn-steps 530 \
        --drop-drawn B/train_config.json --drawn-steps 211 --out-store runs/s43-store   # what two runs drew

The slice is a copy (index lines with their offsets shifted, and token bytes).  A prefix (`--start 0`) with
`--features` lets a run train on what a long `specjax cache-features` pass has finished so far: the cache view
shares the features file (a symlink) and describes only its first N sequences, so `train-drafter --data OUT_STORE
--features OUT_FEATURES` accepts it; N then defaults to the sequences the cache has finished.  A later slice (the
answers a drafter has not seen yet) gets its own cache from `specjax cache-features --data OUT_STORE`.
"""

import argparse
import json
import os
import shutil

from specjax.train.features import FeatureCache
from specjax.train.store import TokenStore
from specjax.train.trainer import SequenceBatches, TrainConfig


def drawn_sequences(store: TokenStore, train_config: str, steps: int) -> set[int]:
    """Store indices of the sequences a run with this train_config.json drew in its batches 0..steps-1."""
    with open(train_config, encoding="utf-8") as fh:
        cfg = TrainConfig(**json.load(fh)["train"])
    batches = SequenceBatches(store, cfg)
    if steps > batches.batches_per_epoch:
        raise SystemExit(f"error: --drawn-steps {steps} is more than one epoch ({batches.batches_per_epoch} batches)")
    return {i for step in range(steps) for i in batches.batch(step)[4]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--start", type=int, default=0, help="first sequence of the slice")
    p.add_argument("--num-sequences", type=int, default=None,
                   help="default: to the store's end, or the sequences the cache has finished")
    p.add_argument("--features", default=None, help="feature cache to view (a prefix only)")
    p.add_argument("--out-store", required=True)
    p.add_argument("--out-features", default=None)
    p.add_argument("--drop-drawn", action="append", default=[], metavar="TRAIN_CONFIG",
                   help="train_config.json of a run over --store: leave out what it drew in --drawn-steps batches "
                        "(repeat both for several runs)")
    p.add_argument("--drawn-steps", action="append", type=int, default=[])
    args = p.parse_args()
    store = TokenStore(args.store)
    if len(args.drop_drawn) != len(args.drawn_steps):
        raise SystemExit("error: --drop-drawn and --drawn-steps go together, one of each per run")
    if args.drop_drawn and args.features is not None:
        raise SystemExit("error: --drop-drawn takes no --features (the slice is not a prefix)")
    if (args.features is None) != (args.out_features is None):
        raise SystemExit("error: --features and --out-features go together")
    if args.features is not None and args.start != 0:
        raise SystemExit("error: a feature cache view must start at sequence 0 (--start 0); cache a later slice "
                         "with `specjax cache-features --data OUT_STORE`")
    cache = FeatureCache(args.features) if args.features is not None else None
    available = len(store) if cache is None else min(cache.meta["done"], len(store))
    n = available - args.start if args.num_sequences is None else args.num_sequences
    if args.start < 0 or not 0 < n <= available - args.start:
        raise SystemExit(f"error: cannot take {n} sequences from {args.start} of {args.store} ({len(store)} "
                         f"sequences" + ("" if cache is None else f", {cache.meta['done']} of them cached") + ")")
    for d in (args.out_store, args.out_features):
        if d is not None and os.path.exists(d):
            raise SystemExit(f"error: {d} exists")
    picked = range(args.start, args.start + n)
    if args.drop_drawn:
        drawn = set().union(*(drawn_sequences(store, c, k) for c, k in zip(args.drop_drawn, args.drawn_steps)))
        picked = [i for i in picked if i not in drawn]
        n = len(picked)
        if n == 0:
            raise SystemExit(f"error: the runs drew every sequence of {args.store}")
    os.makedirs(args.out_store)
    shutil.copy(os.path.join(args.store, "meta.json"), args.out_store)
    size = store.dtype.itemsize
    offset = 0
    with open(os.path.join(args.store, "tokens.bin"), "rb") as src, \
            open(os.path.join(args.out_store, "tokens.bin"), "wb") as dst, \
            open(os.path.join(args.out_store, "index.jsonl"), "w", encoding="utf-8") as index:
        for i in picked:
            r = store.index[i]
            src.seek(r["offset"] * size)
            dst.write(src.read(r["length"] * size))
            index.write(json.dumps(dict(r, offset=offset)) + "\n")
            offset += r["length"]
    prefix = TokenStore(args.out_store)
    if cache is None:
        print(json.dumps({"sequences": n, "tokens": prefix.num_tokens, "store": args.out_store}))
        return 0
    os.makedirs(args.out_features)
    meta = dict(cache.meta, lengths=cache.meta["lengths"][:n], done=n, store=args.out_store,
                store_tokens=prefix.num_tokens)
    with open(os.path.join(args.out_features, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    os.symlink(os.path.abspath(os.path.join(args.features, "features.f16")),
               os.path.join(args.out_features, "features.f16"))
    FeatureCache(args.out_features).check(prefix, cache.tap_indices, cache.hidden, cache.max_len)
    print(json.dumps({"sequences": n, "tokens": prefix.num_tokens, "store": args.out_store,
                      "features": args.out_features}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
