"""Concatenate token stores and their feature caches into one pair, without running the target again."""

from __future__ import annotations

import json
import os

from specjax.train.features import FeatureCache
from specjax.train.store import TokenStore


def merge_stores(pairs: list[tuple[str, str]], out_store: str, out_features: str,
                 keep_first: bool = False) -> tuple[TokenStore, FeatureCache]:
    """(store, feature cache) paths -> one store holding every sequence in order (first pair first) and one cache
    whose rows follow it.  An id in two stores is an error, or with `keep_first` only its first copy is kept.
    Caches must be complete and agree on taps, hidden size and max_len."""
    for path in (out_store, out_features):
        if os.path.exists(path):
            raise ValueError(f"{path} exists: merge into new directories")
    opened = [(TokenStore(s), FeatureCache(f)) for s, f in pairs]
    first = opened[0][1]
    for store, cache in opened:
        cache.check(store, first.tap_indices, first.hidden, first.max_len)
        if cache.tap_indices != first.tap_indices or cache.max_len != first.max_len:
            raise ValueError(f"{cache.path} holds taps {cache.tap_indices} x {cache.max_len} tokens, {first.path} "
                             f"{first.tap_indices} x {first.max_len}")
    vocab = {store.meta["vocab_size"] for store, _ in opened}
    if len(vocab) != 1:
        raise ValueError(f"the stores hold different vocabularies {sorted(vocab)}")
    seen, keep = set(), []  # per store: the indices of the sequences kept
    for store, _ in opened:
        kept = []
        for i, r in enumerate(store.index):
            if r["id"] not in seen:
                kept.append(i)
            elif not keep_first:
                raise ValueError(f"sequence {r['id']} is in more than one store")
        keep.append(kept)
        seen |= store.ids
    out = TokenStore(out_store, vocab.pop(), meta={"merged_from": [s.path for s, _ in opened],
                                                   "parts": [s.meta for s, _ in opened]})
    for (store, _), kept in zip(opened, keep):
        toks = store.tokens()
        for i in kept:
            r = store.index[i]
            out.append(r["id"], r["source"], toks[r["offset"]:r["offset"] + r["length"]], r["prompt_len"], r["finish"])
    os.makedirs(out_features)
    with open(os.path.join(out_features, "features.f16"), "wb") as dst:
        for (_, cache), kept in zip(opened, keep):
            for i in kept:
                dst.write(cache.rows(i).tobytes())
    lengths = [int(cache.lengths[i]) for (_, cache), kept in zip(opened, keep) for i in kept]
    meta = {**first.meta, "store": out.path, "store_tokens": out.num_tokens, "lengths": lengths,
            "done": len(lengths), "merged_from": [c.path for _, c in opened]}
    with open(os.path.join(out_features, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    merged = FeatureCache(out_features)
    merged.check(out, first.tap_indices, first.hidden, first.max_len)
    return out, merged
