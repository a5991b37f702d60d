"""A token store of the first N sequences of another, and a view of its (possibly still partial) feature cache.

    python scripts/prefix_store.py --store data/regen-smollm2 --features runs/features-smollm2 \
        --num-sequences 2048 --out-store runs/prefix-store --out-features runs/prefix-features

Lets a run train on what a long `specjax cache-features` pass has finished so far: the store prefix is a copy
(index lines and token bytes), the cache view shares the features file (a symlink) and describes only its first N
sequences, so `train-drafter --data OUT_STORE --features OUT_FEATURES` accepts it.  N defaults to the sequences
the cache has finished.
"""

import argparse
import json
import os
import shutil

from specjax.train.features import FeatureCache
from specjax.train.store import TokenStore


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--features", required=True)
    p.add_argument("--num-sequences", type=int, default=None, help="default: the sequences the cache has finished")
    p.add_argument("--out-store", required=True)
    p.add_argument("--out-features", required=True)
    args = p.parse_args()
    store, cache = TokenStore(args.store), FeatureCache(args.features)
    n = cache.meta["done"] if args.num_sequences is None else args.num_sequences
    if not 0 < n <= min(cache.meta["done"], len(store)):
        raise SystemExit(f"error: {args.features} has finished {cache.meta['done']} of {len(store)} sequences; "
                         f"cannot take {n}")
    for d in (args.out_store, args.out_features):
        if os.path.exists(d):
            raise SystemExit(f"error: {d} exists")
    os.makedirs(args.out_store)
    shutil.copy(os.path.join(args.store, "meta.json"), args.out_store)
    with open(os.path.join(args.out_store, "index.jsonl"), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in store.index[:n])
    end = store.index[n - 1]["offset"] + store.index[n - 1]["length"]
    with open(os.path.join(args.store, "tokens.bin"), "rb") as src, \
            open(os.path.join(args.out_store, "tokens.bin"), "wb") as dst:
        dst.write(src.read(end * store.dtype.itemsize))
    prefix = TokenStore(args.out_store)
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
