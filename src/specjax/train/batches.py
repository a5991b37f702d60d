"""Training data: `SequenceBatches`, the epoch-shuffled, padded batches of a TokenStore's sequences (a pure function
of (seed, step), so a resumed run needs no data state)."""

from __future__ import annotations

import numpy as np

from specjax.train.config import TrainConfig
from specjax.train.store import TokenStore


class SequenceBatches:
    """Epoch-shuffled batches of (tokens, loss_mask, lengths), padded to multiples of `cfg.pad_multiple` tokens."""

    def __init__(self, store: TokenStore, cfg: TrainConfig, holdout_ids: set[str] = frozenset()):
        self.cfg = cfg
        self.seqs = []
        for index, (rec, toks) in enumerate(store.sequences()):
            if rec["id"] in holdout_ids:
                continue
            toks = toks[: cfg.max_len]
            if len(toks) - rec["prompt_len"] >= 2 * cfg.block_size:  # spec: drop samples with < 2Q response tokens
                self.seqs.append((toks, rec["prompt_len"], index))
        if not self.seqs:
            raise ValueError(f"no usable training sequences in {store.path} (need >= {2 * cfg.block_size} "
                             "response tokens each)")
        self.num_tokens = sum(len(t) for t, _, _ in self.seqs)

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.seqs) // self.cfg.batch_size)

    def batch(self, step: int):
        """The batch of global step `step` (deterministic in (seed, step): resuming needs no data state).

        Returns tokens [B, S], loss mask [B, S], lengths [B], epoch, and the store indices of the B sequences.
        """
        epoch, i = divmod(step, self.batches_per_epoch)
        order = np.random.default_rng((self.cfg.seed, epoch)).permutation(len(self.seqs))
        picked = [self.seqs[j] for j in order[i * self.cfg.batch_size:(i + 1) * self.cfg.batch_size]]
        m = self.cfg.pad_multiple
        s = -(-max(len(t) for t, _, _ in picked) // m) * m
        tokens = np.zeros((len(picked), s), np.int32)
        mask = np.zeros((len(picked), s), bool)
        lengths = np.zeros((len(picked),), np.int32)
        for r, (t, p, _) in enumerate(picked):
            tokens[r, :len(t)] = t
            mask[r, p:len(t)] = True
            lengths[r] = len(t)
        return tokens, mask, lengths, epoch, [i for _, _, i in picked]
