"""A token store of N consecutive sequences of another, and for a prefix a view of its (possibly still partial)
feature cache.

    python scripts/slice_store.py --store data/regen-smollm2 --features runs/features-smollm2 \
        --num-sequences 2048 --out-store runs/prefix-store --out-features runs/prefix-features
    python scripts/slice_store.py --store data/regen-smollm2 --start 5884 --out-store runs/fresh-store

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--start", type=int, default=0, help="first sequence of the slice")
    p.add_argument("--num-sequences", type=int, default=None,
                   help="default: to the store's end, or the sequences the cache has finished")
    p.add_argument("--features", default=None, help="feature cache to view (a prefix only)")
    p.add_argument("--out-store", required=True)
    p.add_argument("--out-features", default=None)
    args = p.parse_args()
    store = TokenStore(args.store)
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
    os.makedirs(args.out_store)
    shutil.copy(os.path.join(args.store, "meta.json"), args.out_store)
    rows = store.index[args.start:args.start + n]
    first, end = rows[0]["offset"], rows[-1]["offset"] + rows[-1]["length"]
    with open(os.path.join(args.out_store, "index.jsonl"), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(dict(r, offset=r["offset"] - first)) + "\n" for r in rows)
    with open(os.path.join(args.store, "tokens.bin"), "rb") as src, \
            open(os.path.join(args.out_store, "tokens.bin"), "wb") as dst:
        src.seek(first * store.dtype.itemsize)
        dst.write(src.read((end - first) * store.dtype.itemsize))
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
