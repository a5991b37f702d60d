"""Merge token stores and their feature caches (training on a mix, e.g. the target's answers plus reference
answers to more prompts), without running the target again (`specjax.train.merge`).

    python scripts/merge_stores.py --out-store runs/mix-smollm2 --out-features runs/features-mix \
        data/regen-smollm2:runs/features-smollm2 runs/text-smollm2:runs/features-text
"""

import argparse

from specjax.train.merge import merge_stores

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", nargs="+", help="STORE:FEATURES")
    ap.add_argument("--out-store", required=True)
    ap.add_argument("--out-features", required=True)
    ap.add_argument("--keep-first", action="store_true", help="an id in several stores: keep its first copy only")
    args = ap.parse_args()
    store, cache = merge_stores([tuple(p.split(":", 1)) for p in args.pairs], args.out_store, args.out_features,
                                args.keep_first)
    print(f"{len(store)} sequences, {store.num_tokens} tokens -> {args.out_store}, {args.out_features}")
