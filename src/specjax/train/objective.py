"""The DFlash training objective (paper Eq. 4; ../shared/docs/dflash-spec.md §5.2) as pure functions.

For a sequence x[0..S-1] with response mask m and frozen target taps, N anchors a_j (response positions,
a_j <= len - Q) each define a block [x[a_j], MASK x (Q-1)] at positions a_j..a_j+Q-1.  A block sees the target
context strictly before its anchor (the anchor's own hidden state does not exist at inference time) and its
own Q tokens bidirectionally, nothing of other blocks.  Slot k (1..Q-1) predicts x[a_j + k] (same position)
through the target's frozen LM head, weighted by keep_j * [a_j + k < len] * m[a_j + k] * exp(-(k - 1) / gamma).

The attention is the SAME function the inference path uses (`cached_and_new_attention`): context K/V play the
role of the cache with a per-query visibility (s < a_j), and the blocks are the step's own rows with a
block-diagonal visibility.  Tests check block logits against the inference drafter run with exactly the rows
before each anchor as context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import DrafterConfig
from specjax.drafter.dflash import DFlashWeights, fuse_context, layer_kv
from specjax.model.attention import cached_and_new_attention
from specjax.model.layers import apply_rope, rms_norm, rope_cos_sin, swiglu


def sample_anchors(rng: np.random.Generator, loss_mask: np.ndarray, lengths: np.ndarray, num_anchors: int,
                   block_size: int):
    """Host-side anchor sampling: -> (anchors [Bt, N] int32, keep [Bt, N] bool), sorted per sequence.

    Valid anchors are response positions a with a <= length - Q (uniform, without replacement); sequences with
    fewer valid positions get padding blocks (keep = False).
    """
    bt = loss_mask.shape[0]
    anchors = np.zeros((bt, num_anchors), np.int32)
    keep = np.zeros((bt, num_anchors), bool)
    for i in range(bt):
        valid = np.nonzero(loss_mask[i, : max(0, lengths[i] - block_size + 1)])[0]
        n = min(num_anchors, len(valid))
        if n:
            anchors[i, :n] = np.sort(rng.choice(valid, size=n, replace=False))
            keep[i, :n] = True
    return anchors, keep


def block_logits(weights: DFlashWeights, cfg: DrafterConfig, embed, output_head, tokens, taps, anchors, keep,
                 block_size: int):
    """Training forward: tokens [Bt, S], taps [Bt, S, F*Ht], anchors/keep [Bt, N] -> logits [Bt, N, Q-1, V]."""
    bt, s = tokens.shape
    n = anchors.shape[1]
    q_len = n * block_size
    block_pos = (anchors[:, :, None] + jnp.arange(block_size)[None, None, :]).reshape(bt, q_len)  # [Bt, N*Q]
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [Bt, N]
    ids = jnp.concatenate([first[..., None], jnp.full((bt, n, block_size - 1), cfg.mask_token_id, tokens.dtype)],
                          axis=-1).reshape(bt, q_len)
    x = embed[ids]
    if weights.mask_embedding is not None:
        is_mask = (jnp.arange(q_len) % block_size > 0)[None, :, None]
        x = jnp.where(is_mask, weights.mask_embedding.astype(x.dtype), x)
    ctx = fuse_context(weights, cfg, taps)  # [Bt, S, H]
    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    ctx_cos, ctx_sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(s)[None], (bt, s)), inv_freq)
    cos, sin = rope_cos_sin(block_pos, inv_freq)
    query_anchor = jnp.repeat(anchors, block_size, axis=1)  # [Bt, N*Q]
    ctx_visible = jnp.arange(s)[None, None, :] < query_anchor[:, :, None]  # strictly before the anchor
    block_id = jnp.arange(q_len) // block_size
    same_block = (block_id[:, None] == block_id[None, :])[None] & jnp.repeat(keep, block_size, axis=1)[:, None, :]
    for layer in weights.layers:
        kc, vc = layer_kv(layer, cfg, ctx, ctx_cos, ctx_sin)  # [Bt, S, K, Dh]
        xn = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q = rms_norm((xn @ layer.w_q).reshape(bt, q_len, cfg.num_heads, cfg.head_dim), layer.q_norm,
                     cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kb, vb = layer_kv(layer, cfg, xn, cos, sin)
        o = cached_and_new_attention(q, kc.transpose(2, 0, 1, 3), vc.transpose(2, 0, 1, 3), ctx_visible, kb, vb,
                                     same_block, cfg.head_dim ** -0.5)
        x = x + o.reshape(bt, q_len, -1) @ layer.w_o
        x = x + swiglu(rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer.w_gate_up, layer.w_down)
    h = rms_norm(x, weights.norm, cfg.rms_norm_eps).reshape(bt, n, block_size, -1)[:, :, 1:]  # slots 1..Q-1
    return jnp.einsum("bnkd,dv->bnkv", h, output_head, preferred_element_type=jnp.float32)


def labels_and_weights(tokens, loss_mask, lengths, anchors, keep, block_size: int, gamma: float):
    """Same-position labels x[a_j + k] and weights for slots k = 1..Q-1 -> ([Bt, N, Q-1] int32, float32)."""
    k = jnp.arange(1, block_size)
    pos = anchors[:, :, None] + k[None, None, :]  # [Bt, N, Q-1]
    inside = pos < lengths[:, None, None]
    safe = jnp.where(inside, pos, 0)
    labels = jnp.take_along_axis(tokens[:, None, :], safe, axis=2)
    resp = jnp.take_along_axis(loss_mask[:, None, :], safe, axis=2)
    decay = jnp.exp(-(k - 1) / gamma)[None, None, :]
    weights = keep[..., None] * inside * resp * decay
    return labels, weights.astype(jnp.float32)


def dflash_loss(weights: DFlashWeights, cfg: DrafterConfig, embed, output_head, tokens, taps, loss_mask, lengths,
                anchors, keep, block_size: int, gamma: float):
    """Weighted cross-entropy (sum w * CE / sum w) and unweighted accuracy / per-slot accuracy over the mask."""
    logits = block_logits(weights, cfg, embed, output_head, tokens, taps, anchors, keep, block_size)
    labels, w = labels_and_weights(tokens, loss_mask, lengths, anchors, keep, block_size, gamma)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    ce = logz - target
    loss = (w * ce).sum() / (w.sum() + 1e-6)
    valid = (w > 0).astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32) * valid
    per_slot = correct.sum((0, 1)) / jnp.maximum(valid.sum((0, 1)), 1.0)
    return loss, {"acc": correct.sum() / jnp.maximum(valid.sum(), 1.0), "acc_per_slot": per_slot,
                  "num_labels": valid.sum()}
