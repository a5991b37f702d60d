"""The readable single-request speculative loop: the oracle for the batched engine.

No caches survive between steps: every step recomputes the target over the whole sequence and rebuilds the
drafter context from scratch, so cache appends, rollbacks, page tables and batching cannot be wrong here.
Acceptance is a plain Python loop.  Slow (quadratic) and only meant for tests with tiny models.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.model import target as tgt
from specjax.model.attention import write_rows
from specjax.sampling import SAMPLE_FILTERED, SamplingParams, sample_tokens


@partial(jax.jit, static_argnames=("cfg", "tap_indices"))
def _full_forward(weights, tokens, cfg: ModelConfig, tap_indices):
    n = tokens.shape[1]
    kv = tgt.init_kv_pages(cfg.num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim, weights.embed.dtype)
    batch = tgt.ForwardBatch(tokens, jnp.arange(n)[None], n + jnp.arange(n)[None], jnp.asarray([[1]]))
    hidden, taps, _ = tgt.forward(weights, kv, batch, cfg, tap_indices)
    return tgt.logits(weights, hidden)[0], None if taps is None else taps[0]


def full_forward(weights: tgt.TargetWeights, cfg: ModelConfig, tokens: list[int], tap_indices=()):
    """Target over the whole sequence with a fresh single-page cache -> (logits [T, V], taps [T, F*D] | None).

    The sequence is right-padded to a multiple of 64 (causal attention: padding cannot affect real rows) so that
    the oracle compiles a handful of shapes instead of one per length.
    """
    n = len(tokens)
    padded = np.zeros((1, -(-n // 64) * 64), np.int32)
    padded[0, :n] = tokens
    logits, taps = _full_forward(weights, jnp.asarray(padded), cfg, tuple(tap_indices))
    return np.asarray(logits)[:n], None if taps is None else taps[:n]


_sample_tokens = jax.jit(sample_tokens, static_argnames="mode")


def sample_at(logits_row: np.ndarray, params: SamplingParams, seed: int, position: int) -> int:
    """The target's token for `position` given its logits row (same keys as the engine)."""
    if params.is_greedy:
        return int(np.argmax(logits_row))
    tok = _sample_tokens(
        jnp.asarray(logits_row)[None, None], jnp.asarray([params.temperature], jnp.float32),
        jnp.asarray([params.top_k]), jnp.asarray([params.top_p], jnp.float32), jnp.asarray([seed]),
        jnp.asarray([[position]]), mode=SAMPLE_FILTERED)
    return int(tok[0, 0])


def reference_generate(weights, cfg: ModelConfig, prompt: list[int], params: SamplingParams, seed: int = 0,
                       propose=None, num_draft: int = 0, eos_token_ids=(), max_model_len: int | None = None):
    """Speculative generation for one request.

    `propose(tokens, tap_rows, k)` returns k draft tokens for the continuation of `tokens` (the last of which
    is the bonus), given target taps for every position before the bonus; None means plain decoding.
    Returns (output token ids, per-step acceptance lengths).
    """
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    max_len = max_model_len or cfg.max_position_embeddings
    logits, _ = full_forward(weights, cfg, prompt)
    out = [sample_at(logits[-1], params, seed, len(prompt))]
    taus = []
    while out[-1] not in stop and len(out) < params.max_new_tokens and len(prompt) + len(out) < max_len:
        seq = prompt + out
        s = len(seq) - 1  # position of the bonus token
        k = max(0, min(num_draft, params.max_new_tokens - len(out) - 1, max_len - len(seq) - 1))
        drafts = []
        if propose is not None and k:
            drafts = [int(d) for d in propose(seq, k)][:k]
        logits, _ = full_forward(weights, cfg, seq + drafts)
        accepted = 0
        for j in range(len(drafts) + 1):
            tok = sample_at(logits[s + j], params, seed, s + j + 1)  # the target's own token for s + j + 1
            if j < len(drafts) and tok == drafts[j]:
                accepted += 1
                continue
            break
        new = drafts[:accepted] + [tok]
        taus.append(accepted + 1)
        for t in new:
            out.append(t)
            if t in stop or len(out) >= params.max_new_tokens or len(prompt) + len(out) >= max_len:
                break
    return out, taus


def dflash_reference_proposer(weights, cfg: ModelConfig, dcfg, dweights, block_size: int):
    """A `propose` for reference_generate that rebuilds the DFlash drafter context from scratch every step."""
    def propose(seq: list[int], k: int) -> list[int]:
        s = len(seq) - 1
        _, taps = full_forward(weights, cfg, seq, dcfg.hidden_state_indices)
        padded = -(-s // 64) * 64  # context rows padded (and masked) to limit the number of compiled shapes
        rows = np.zeros((1, padded, taps.shape[-1]), np.float32)
        rows[0, :s] = np.asarray(taps[:s])
        logits = _draft_from_scratch(dweights, weights, jnp.asarray(rows), jnp.asarray([seq[-1]]), jnp.asarray([s]),
                                     dcfg=dcfg, num_draft=k, block_size=block_size)
        return [int(t) for t in np.asarray(logits[0]).argmax(-1)]

    return propose


@partial(jax.jit, static_argnames=("dcfg", "num_draft", "block_size"))
def _draft_from_scratch(dweights, weights, rows, bonus, s, *, dcfg, num_draft, block_size):
    """Fresh drafter context from every row < s (one page holding positions 0..n-1), then one block."""
    from specjax.drafter import dflash

    n = rows.shape[1]
    dkv = tgt.init_kv_pages(dcfg.num_layers, 2, n, dcfg.num_kv_heads, dcfg.head_dim, weights.embed.dtype)
    pos = jnp.arange(n)[None]
    dkv = write_rows(dkv, jnp.where(pos < s[:, None], n + pos, -1), dflash.observe(dweights, dcfg, rows, pos))
    return dflash.propose_logits(dweights, dcfg, dkv, weights.embed, weights.vocab_rows, bonus, s,
                                 jnp.asarray([[1]]), num_draft, block_size)
