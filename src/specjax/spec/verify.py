"""Lossless acceptance of a drafted block: longest matching prefix + one bonus token, greedy or sampled.

The target scores [bonus, d_1, ..., d_K] in one forward; logits row j is the target distribution p_j for
position s + j + 1.  For every row the target draws its own token t_j ~ p_j (argmax at temperature 0).  Draft
d_{j+1} is accepted while d_{j+1} == t_j; the first mismatch (or t_K when all K are accepted) is the bonus.

Why this is exact rejection sampling (Leviathan et al.) for a deterministic draft q = delta(d):
  * P(accept d) = P(t_j = d) = p_j(d) = min(1, p_j(d) / q(d)), the standard acceptance probability;
  * given rejection, t_j is distributed as p_j restricted to tokens != d, renormalised, which is the residual
    norm(max(p_j - q, 0)).
So the emitted tokens follow the target distribution exactly.  At temperature 0, t_j = argmax p_j and this is
the greedy rule `cumprod(d == argmax).sum()` of the z-lab reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample_tokens


def accepted_length(drafts: jax.Array, target_tokens: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """Length of the longest prefix with drafts[:, j] == target_tokens[:, j], capped at num_drafts [B].

    Example: drafts [[5, 7, 9]], target [[5, 7, 2, 4]], num_drafts [3] -> [2].
    """
    k = drafts.shape[1]
    match = (drafts == target_tokens[:, :k]) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    return jnp.cumprod(match.astype(jnp.int32), axis=1).sum(axis=1)


def accept(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, start: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seeds: jax.Array, mode: str,
           greedy: jax.Array | None = None):
    """Verify drafts [B, K] against target logits [B, K + 1, V] of the block starting at positions `start` [B]
    (`greedy`: their argmax, if already known; see `sample_tokens`).

    Returns (num_accepted [B], tokens [B, K + 1]): the step emits tokens[:, :num_accepted + 1], i.e. the
    accepted drafts followed by the bonus token.
    """
    positions = start[:, None] + 1 + jnp.arange(logits.shape[1])[None, :]  # row j samples position s + j + 1
    target_tokens = sample_tokens(logits, temperature, top_k, top_p, seeds, positions, mode, greedy)  # [B, K + 1]
    return accepted_length(drafts, target_tokens, num_drafts), target_tokens


def emitted(num_accepted: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mask [B, K + 1] of the tokens a step commits (the accepted drafts and the bonus)."""
    return jnp.arange(tokens.shape[1])[None, :] <= num_accepted[:, None]


__all__ = ["accept", "accepted_length", "emitted"]
