"""Context vocabulary: the prompt tokens outside a drafter's draft vocabulary that its blocks may draft too.

A draft vocabulary (the 8,192 most frequent answer tokens) misses 2.7-5.9% of the target's answer tokens on
the held-out prompts, and about 70% of those are in the prompt: names, identifiers, rare words the answer
copies.  The drafter's hidden state already points at them (its head is the target's), so scoring a few such
rows per sequence beside the draft vocabulary's drafts them (docs/results/training.md; commit 14e1b2b, 2026-12-07).
"""

from __future__ import annotations

import numpy as np


def draft_mask(draft_ids, vocab_size: int) -> np.ndarray:
    """bool [vocab_size]: True at the draft vocabulary's ids."""
    mask = np.zeros(vocab_size, bool)
    mask[np.asarray(draft_ids)] = True
    return mask


def context_ids(token_ids, draftable: np.ndarray, size: int) -> np.ndarray:
    """int32 [size]: the last `size` distinct ids of `token_ids` with `draftable[id]` False, the most recent
    first, padded with -1."""
    out = np.full(size, -1, np.int32)
    seen: set[int] = set()
    for t in reversed(token_ids):
        t = int(t)
        if len(seen) == size:
            break
        if not draftable[t] and t not in seen:
            out[len(seen)] = t
            seen.add(t)
    return out
