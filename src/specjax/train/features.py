"""On-disk cache of frozen-target tap features for a TokenStore (float16, one row per training token).

Measured on the 2-core CPU with SmolLM2 (batch 4 x <=512 tokens): the target forward that produces the taps
costs ~2.8 s, the drafter's loss+backward ~2.7 s.  Online features therefore double the cost of every epoch;
a cache pays one forward per token once and is shared by every run and method whose taps it holds (DFlash
and EAGLE-3 read different subsets of one cache).  Layout of a cache directory:
  meta.json       tap indices, hidden size, max_len, store path/size, sequences done (resume point)
  features.f16    [rows, num_taps, hidden] float16; sequence i occupies rows offset_i .. offset_i + len_i
Rows follow the store's order, each sequence truncated to max_len.  float16 keeps 11 mantissa bits (bf16: 8)
and the cache refuses values beyond its range instead of storing infinities.

Also the taps themselves: `target_features` (one frozen-target forward) and `batch_features` (a training batch's
taps, from the cache when there is one, else that forward).
"""

from __future__ import annotations

import json
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.model import target as tgt
from specjax.train.store import TokenStore

F16_MAX = 65504.0


@partial(jax.jit, static_argnames=("tcfg", "tap_indices"))
def target_features(tw: tgt.TargetWeights, tokens, tcfg: ModelConfig, tap_indices: tuple[int, ...]):
    """Frozen target taps for whole sequences [Bt, S] (causal within the sequence, nothing cached)."""
    bt, s = tokens.shape
    kv = tgt.init_kv_pages(tcfg.num_layers, 1, 1, tcfg.num_kv_heads, tcfg.head_dim, tw.embed.dtype)
    batch = tgt.ForwardBatch(tokens, jnp.broadcast_to(jnp.arange(s)[None], (bt, s)),
                             jnp.zeros((bt, s), jnp.int32), jnp.zeros((bt, 1), jnp.int32))
    _, taps, _ = tgt.forward(tw, kv, batch, tcfg, tap_indices)
    return jax.lax.stop_gradient(taps)


def batch_features(target, tokens, seq_indices, tap_indices, cache=None) -> jax.Array:
    """Taps for a training batch: from the feature cache when there is one, else one target forward."""
    if cache is not None:
        return jnp.asarray(cache.batch(seq_indices, tokens.shape[1], tap_indices))
    return target_features(target.weights, jnp.asarray(tokens), target.config, tap_indices)


class FeatureCache:
    def __init__(self, path: str):
        meta_path = os.path.join(path, "meta.json")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{path} is not a feature cache (no meta.json); build one with "
                                    "`specjax cache-features`")
        with open(meta_path, encoding="utf-8") as fh:
            self.meta = json.load(fh)
        self.path = path
        self.tap_indices = tuple(self.meta["tap_indices"])
        self.hidden = self.meta["hidden_size"]
        self.max_len = self.meta["max_len"]
        # the kernels' activations ("int16" / "int8" / "float32") when the target ran on the GGUF-block CPU kernels,
        # None for XLA's float32 forward (caches from before this field)
        self.kernel_activations = self.meta.get("kernel_activations")
        self.lengths = np.asarray(self.meta["lengths"], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        rows = int(self.lengths.sum())
        self._data = np.memmap(os.path.join(path, "features.f16"), np.float16, "r",
                               shape=(rows, len(self.tap_indices), self.hidden)) if rows else None

    @property
    def complete(self) -> bool:
        return self.meta["done"] == len(self.lengths)

    def check(self, store: TokenStore, tap_indices, hidden_size: int, max_len: int) -> None:
        """Raise ValueError naming the mismatch if this cache cannot serve training with these settings."""
        if not self.complete:
            raise ValueError(f"feature cache {self.path} is incomplete ({self.meta['done']}/{len(self.lengths)} "
                             "sequences): rerun `specjax cache-features` to finish it")
        if len(self.lengths) != len(store) or self.meta["store_tokens"] != store.num_tokens:
            raise ValueError(f"feature cache {self.path} was built for a store of {len(self.lengths)} sequences / "
                             f"{self.meta['store_tokens']} tokens, but {store.path} holds {len(store)} / "
                             f"{store.num_tokens}")
        missing = [i for i in tap_indices if i not in self.tap_indices]
        if missing:
            raise ValueError(f"feature cache {self.path} holds taps {self.tap_indices}, not {missing}")
        if hidden_size != self.hidden:
            raise ValueError(f"feature cache hidden size {self.hidden} != target hidden size {hidden_size}")
        if max_len > self.max_len:
            raise ValueError(f"feature cache holds the first {self.max_len} tokens per sequence, "
                             f"training asks for max_len={max_len}")

    def rows(self, i: int) -> np.ndarray:
        """Sequence i's cached rows, [length, num_taps, hidden] float16 (a view of the file)."""
        return self._data[self.offsets[i]:self.offsets[i] + self.lengths[i]]

    def batch(self, seq_indices, width: int, tap_indices) -> np.ndarray:
        """Taps [len(seq_indices), width, len(tap_indices) * hidden] float32, zero past each sequence."""
        cols = [self.tap_indices.index(i) for i in tap_indices]
        out = np.zeros((len(seq_indices), width, len(cols), self.hidden), np.float32)
        for r, i in enumerate(seq_indices):
            n = min(int(self.lengths[i]), width)
            out[r, :n] = self.rows(i)[:n, cols]
        return out.reshape(len(seq_indices), width, -1)


def build_feature_cache(target, store: TokenStore, out: str, tap_indices, max_len: int, batch_tokens: int = 2048,
                        progress=None, mesh=None, window: int = 256) -> FeatureCache:
    """Run the frozen target over every stored sequence once and write its taps (resumes a partial cache, and
    extends a complete one when the store has grown since: `specjax regenerate` only appends).  `mesh`: split
    each forward's sequences over its devices (the target replicated there); a target loaded tensor-parallel
    runs split as it is.  Sequences go in windows of `window` in store order, sorted by length inside a window
    so that the sequences of one forward have similar lengths (on the SmolLM2 store 89% of the computed rows are
    real tokens, 68% in store order); the resume point advances a window at a time.  `progress(done, total)`
    is called after every forward."""
    from specjax.parallel import mesh_size, replicate, shard_batch

    weights = replicate(target.weights, mesh)

    tap_indices = tuple(sorted(set(tap_indices)))
    hidden = target.config.hidden_size
    lengths = [min(r["length"], max_len) for r in store.index]
    meta_path = os.path.join(out, "meta.json")
    meta = {"tap_indices": list(tap_indices), "hidden_size": hidden, "max_len": max_len, "store": store.path,
            "store_tokens": store.num_tokens, "lengths": lengths, "done": 0,
            "kernel_activations": target.kernel_activations}
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as fh:
            old = json.load(fh)
        settings = ("tap_indices", "hidden_size", "max_len", "kernel_activations")
        grown = old["lengths"] == lengths[:len(old["lengths"])]  # the store is append-only: keep what is cached
        if any(old.get(k) != meta[k] for k in settings) or not grown:
            raise ValueError(f"{out} holds a feature cache built with other settings or data; use a new --out")
        meta["done"] = old["done"]
    os.makedirs(out, exist_ok=True)
    rows = sum(lengths)
    path = os.path.join(out, "features.f16")
    with open(path, "ab") as fh:
        fh.truncate(rows * len(tap_indices) * hidden * 2)
    data = np.memmap(path, np.float16, "r+", shape=(rows, len(tap_indices), hidden))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens_all = store.tokens()
    for start in range(meta["done"], len(lengths), window):
        end = min(start + window, len(lengths))
        todo = sorted(range(start, end), key=lambda j: lengths[j])
        while todo:
            # greedy groups of similar lengths; rows per call fixed by the width bucket, so few shapes compile
            width = -(-lengths[todo[0]] // 64) * 64
            group = [todo[0]]
            for j in todo[1:]:
                w = max(width, -(-lengths[j] // 64) * 64)
                if (len(group) + 1) * w > batch_tokens:
                    break
                group.append(j)
                width = w
            del todo[:len(group)]
            rows_per_call = -(-max(1, batch_tokens // width) // mesh_size(mesh)) * mesh_size(mesh)
            toks = np.zeros((rows_per_call, width), np.int32)
            for r, j in enumerate(group):
                rec = store.index[j]
                toks[r, :lengths[j]] = tokens_all[rec["offset"]:rec["offset"] + lengths[j]]
            taps = np.asarray(target_features(weights, shard_batch(jnp.asarray(toks), mesh), target.config,
                                              tap_indices))
            taps = taps.reshape(rows_per_call, width, len(tap_indices), hidden)
            for r, j in enumerate(group):
                x = taps[r, :lengths[j]]
                peak = float(np.abs(x).max())
                if not np.isfinite(peak) or peak > F16_MAX:
                    raise ValueError(f"target taps reach {peak:.3g} on sequence {store.index[j]['id']}: beyond "
                                     "float16; train with online features instead")
                data[offsets[j]:offsets[j] + lengths[j]] = x.astype(np.float16)
            if not todo:  # the window is written: it becomes the resume point
                data.flush()
                meta["done"] = end
                with open(meta_path + ".tmp", "w", encoding="utf-8") as fh:
                    json.dump(meta, fh)
                os.replace(meta_path + ".tmp", meta_path)
            if progress is not None:
                progress(end - len(todo), len(lengths))
    del data
    return FeatureCache(out)
