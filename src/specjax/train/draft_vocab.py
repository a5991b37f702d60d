"""The draft vocabulary of a drafter: the most frequent response tokens of its training data
(`draft_vocabulary`), ties and unseen tokens ranked by counts over existing answer texts (`background_counts`)."""

from __future__ import annotations

import numpy as np


def draft_vocab_from_counts(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids (sorted ascending), EAGLE-3's draft vocabulary."""
    top = np.argsort(-counts, kind="stable")[:size]
    return np.sort(top)


def draft_vocabulary(store, vocab_size: int, size: int, background=None):
    """The `size` most frequent response tokens of `store` (sorted ids) and the share of responses they cover.

    `background` [V] (token counts of other text) ranks the tokens the store never shows: a store of a few
    hundred answers holds only ~4.4k distinct tokens, and filling the rest of an 8k vocabulary by id order
    (what zero counts give) wastes it.  Store counts always rank first.
    """
    counts = np.zeros(vocab_size, np.int64)
    for rec, toks in store.sequences():
        counts += np.bincount(toks[rec["prompt_len"]:], minlength=vocab_size)
    score = counts.astype(np.float64)
    if background is not None:
        score += np.asarray(background, np.float64) / (1.0 + float(np.max(background)))  # < 1: breaks ties only
    ids = draft_vocab_from_counts(score, min(size, vocab_size))
    return ids, float(counts[ids].sum() / max(1, counts.sum()))


def background_counts(tokenizer, vocab_size: int, data_dir=None, sharegpt_file=None, max_chars: int = 2_000_000):
    """Token counts over the existing answer texts of the training sources (no model run: tokenizer only)."""
    from specjax.datasets import load_train_texts

    counts = np.zeros(vocab_size, np.int64)
    for text in load_train_texts(data_dir=data_dir, sharegpt_file=sharegpt_file, max_chars_per_source=max_chars):
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int64)
        counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts
