"""Append-only, crash-safe store of token sequences (prompt + target response) for drafter training.

Layout of a store directory:
  meta.json    vocab size, token dtype, who generated the data and how
  tokens.bin   all sequences back to back (uint16 when the vocabulary fits, else uint32)
  index.jsonl  one line per finished sequence: id, source, offset, length, prompt_len, finish_reason

A sequence is durable once its index line is written (tokens are flushed and fsynced first).  Opening a store
never writes: readers (training runs, often several at once, or beside a writer) ignore a torn last index line
and token bytes past the last indexed sequence.  The first append repairs them (a crash mid-write), so an
interrupted run resumes without losing or duplicating finished work.
"""

from __future__ import annotations

import json
import os

import numpy as np


class TokenStore:
    def __init__(self, path: str, vocab_size: int | None = None, meta: dict | None = None):
        self.path = path
        os.makedirs(path, exist_ok=True)
        meta_path = os.path.join(path, "meta.json")
        if os.path.isfile(meta_path):
            with open(meta_path, encoding="utf-8") as fh:
                self.meta = json.load(fh)
            if vocab_size is not None and self.meta["vocab_size"] != vocab_size:
                raise ValueError(f"store {path} holds vocab_size={self.meta['vocab_size']} tokens, not {vocab_size}")
        else:
            if vocab_size is None:
                raise ValueError(f"{path} is not a token store (no meta.json)")
            self.meta = {"vocab_size": vocab_size, "dtype": "uint16" if vocab_size <= 65536 else "uint32",
                         **(meta or {})}
            with open(meta_path, "w", encoding="utf-8") as fh:
                json.dump(self.meta, fh, indent=1)
        self.dtype = np.dtype(self.meta["dtype"])
        self.index: list[dict] = []
        index_path = os.path.join(path, "index.jsonl")
        self._torn = False  # a torn index line to drop before the next append
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        self.index.append(json.loads(line))
                    except json.JSONDecodeError:
                        self._torn = True  # a torn last line: everything from it on is ignored
                        break
        self.ids = {r["id"] for r in self.index}
        self._end = (self.index[-1]["offset"] + self.index[-1]["length"]) if self.index else 0
        self._repaired = False

    def _repair(self) -> None:
        """Before the first append: drop a torn index tail and token bytes no index line covers."""
        if self._torn:
            with open(os.path.join(self.path, "index.jsonl"), "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in self.index)
        with open(os.path.join(self.path, "tokens.bin"), "ab") as fh:
            if fh.tell() > self._end * self.dtype.itemsize:
                fh.truncate(self._end * self.dtype.itemsize)
        self._torn, self._repaired = False, True

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        return self._end

    def append(self, seq_id: str, source: str, token_ids, prompt_len: int, finish_reason: str | None) -> None:
        arr = np.asarray(token_ids, dtype=self.dtype)
        if not self._repaired:
            self._repair()
        with open(os.path.join(self.path, "tokens.bin"), "ab") as fh:
            fh.write(arr.tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        record = {"id": seq_id, "source": source, "offset": self._end, "length": int(arr.size),
                  "prompt_len": int(prompt_len), "finish": finish_reason}
        with open(os.path.join(self.path, "index.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.index.append(record)
        self.ids.add(seq_id)
        self._end += int(arr.size)

    def tokens(self) -> np.ndarray:
        """All tokens as one read-only memory map."""
        if self._end == 0:
            return np.zeros((0,), self.dtype)
        return np.memmap(os.path.join(self.path, "tokens.bin"), dtype=self.dtype, mode="r", shape=(self._end,))

    def sequences(self):
        """(record, token array) for every stored sequence."""
        toks = self.tokens()
        for r in self.index:
            yield r, np.asarray(toks[r["offset"]:r["offset"] + r["length"]], dtype=np.int32)


class StoreUnion:
    """Several token stores read as one training set (e.g. greedy answers plus sampled ones), in the given order."""

    def __init__(self, stores: list[TokenStore]):
        vocabs = {s.meta["vocab_size"] for s in stores}
        if len(vocabs) != 1:
            raise ValueError(f"stores {', '.join(s.path for s in stores)} hold different vocabularies "
                             f"({sorted(vocabs)})")
        self.stores = stores
        self.path = ",".join(s.path for s in stores)

    def __len__(self) -> int:
        return sum(len(s) for s in self.stores)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.stores)

    def sequences(self):
        for s in self.stores:
            yield from s.sequences()


def open_stores(spec: str) -> TokenStore | StoreUnion:
    """`--data PATH[,PATH...]`: one store, or several read as one."""
    paths = [p for p in spec.split(",") if p]
    if not paths:
        raise ValueError(f"no token store named in {spec!r}")
    for p in paths:
        if not os.path.isfile(os.path.join(p, "meta.json")):
            raise ValueError(f"{p} is not a token store (no meta.json)")
    stores = [TokenStore(p) for p in paths]
    return stores[0] if len(stores) == 1 else StoreUnion(stores)
