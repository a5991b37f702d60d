"""The DFlash training objective (paper Eq. 4; ../shared/docs/dflash-spec.md §5.2) as pure functions.

For a sequence x[0..S-1] with response mask m and frozen target taps, N anchors a_j (response positions,
a_j <= len - Q) each define a block [x[a_j], MASK x (Q-1)] at positions a_j..a_j+Q-1.  A block sees the target
context strictly before its anchor (the anchor's own hidden state does not exist at inference time) and its
own Q tokens bidirectionally, nothing of other blocks.  Slot k (1..Q-1) predicts x[a_j + k] (same position)
through the target's frozen LM head, weighted by keep_j * [a_j + k < len] * m[a_j + k] * exp(-(k - 1) / gamma).

The attention is the inference softmax (`cached_and_new_attention`: context rows with a per-block visibility
s < a_j, plus the block's own rows) computed block-locally: N blocks never attend to each other, so no
(N*Q)^2 score matrix is formed and anchors can sit at every response position.  Tests check block logits
against the inference drafter run with exactly the rows before each anchor as context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import DrafterConfig
from specjax.drafter.dflash import DFlashWeights, block_embeddings, fuse_context, layer_kv
from specjax.model.layers import MASK_VALUE, apply_rope, rms_norm, rope_cos_sin, swiglu


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


def block_local_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk, scale):
    """Attention of N independent blocks over one shared context, each block also over its own Q rows only.

    q [Bt, N, Q, Hq, D]; k_ctx, v_ctx [Bt, S, K, D]; ctx_visible [Bt, N, S] (block j sees s < a_j);
    k_blk, v_blk [Bt, N, Q, K, D] (bidirectional inside a block).  -> [Bt, N, Q, Hq, D].  The same softmax as
    `cached_and_new_attention` with a block-diagonal visibility, without forming the (N*Q)^2 score matrix.
    """
    bt, n, qn, hq, d = q.shape
    kv = k_ctx.shape[2]
    g = hq // kv
    qq = q.reshape(bt, n, qn, kv, g, d)
    s_ctx = jnp.einsum("bnqkgd,bskd->bkngqs", qq, k_ctx, preferred_element_type=jnp.float32) * scale
    s_ctx = jnp.where(ctx_visible[:, None, :, None, None, :], s_ctx, MASK_VALUE)
    s_blk = jnp.einsum("bnqkgd,bnpkd->bkngqp", qq, k_blk, preferred_element_type=jnp.float32) * scale
    m = jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))
    p_ctx, p_blk = jnp.exp(s_ctx - m), jnp.exp(s_blk - m)
    denom = p_ctx.sum(-1, keepdims=True) + p_blk.sum(-1, keepdims=True)
    out = (jnp.einsum("bkngqs,bskd->bkngqd", p_ctx.astype(v_ctx.dtype), v_ctx)
           + jnp.einsum("bkngqp,bnpkd->bkngqd", p_blk.astype(v_blk.dtype), v_blk)) / denom.astype(v_blk.dtype)
    return out.transpose(0, 2, 4, 1, 3, 5).reshape(bt, n, qn, hq, d)


def block_logits(weights: DFlashWeights, cfg: DrafterConfig, embed, output_head, tokens, taps, anchors, keep,
                 block_size: int, extra=None):
    """Training forward: tokens [Bt, S], taps [Bt, S, F*Ht], anchors/keep [Bt, N] -> logits [Bt, N, Q-1, V].

    `output_head` [H, V] is the target head or its draft-vocabulary rows (then V = V_d).  `extra` = (ids [Bt, E],
    rows [V_all, H]: the target head's rows, TargetWeights.vocab_rows): each sequence's own extra target ids (-1 =
    none; the engine's context vocabulary, spec/context_vocab.py) scored after those V columns, -inf where -1.
    Padding blocks (keep = False) are computed like the others and weighted 0 by the loss.
    """
    del keep  # blocks never see each other, so a padding block cannot disturb a real one
    bt, s = tokens.shape
    n = anchors.shape[1]
    block_pos = anchors[:, :, None] + jnp.arange(block_size)[None, None, :]  # [Bt, N, Q]
    x = block_embeddings(weights, cfg, embed, jnp.take_along_axis(tokens, anchors, axis=1), block_size)
    ctx = fuse_context(weights, cfg, taps)  # [Bt, S, H]
    inv_freq = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    ctx_cos, ctx_sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(s)[None], (bt, s)), inv_freq)
    cos, sin = rope_cos_sin(block_pos.reshape(bt, n * block_size), inv_freq)
    ctx_visible = jnp.arange(s)[None, None, :] < anchors[:, :, None]  # [Bt, N, S]: strictly before the anchor
    x = x.reshape(bt, n * block_size, -1)
    for layer in weights.layers:
        kc, vc = layer_kv(layer, cfg, ctx, ctx_cos, ctx_sin)  # [Bt, S, K, Dh]
        xn = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q = rms_norm((xn @ layer.w_q).reshape(bt, n * block_size, cfg.num_heads, cfg.head_dim), layer.q_norm,
                     cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kb, vb = layer_kv(layer, cfg, xn, cos, sin)  # [Bt, N*Q, K, Dh]
        blocks = (bt, n, block_size)
        o = block_local_attention(q.reshape(*blocks, *q.shape[2:]), kc, vc, ctx_visible,
                                  kb.reshape(*blocks, *kb.shape[2:]), vb.reshape(*blocks, *vb.shape[2:]),
                                  cfg.head_dim ** -0.5)
        x = x + o.reshape(bt, n * block_size, -1) @ layer.w_o
        x = x + swiglu(rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer.w_gate_up, layer.w_down)
    h = rms_norm(x, weights.norm, cfg.rms_norm_eps).reshape(bt, n, block_size, -1)[:, :, 1:]  # slots 1..Q-1
    logits = jnp.einsum("bnkd,dv->bnkv", h, output_head, preferred_element_type=jnp.float32)
    if extra is None:
        return logits
    ids, rows = extra
    more = jnp.einsum("bnkd,bed->bnke", h, jnp.take(rows, jnp.maximum(ids, 0), axis=0).astype(h.dtype),
                      preferred_element_type=jnp.float32)
    return jnp.concatenate([logits, jnp.where(ids[:, None, None, :] >= 0, more, -jnp.inf)], axis=-1)


def scored_labels(labels, t2d, extra_ids, num_rows: int):
    """Target-id labels [Bt, N, Q-1] -> columns of `block_logits`: the draft vocabulary's index (`t2d`, or the id
    itself without one), else num_rows + e where the sequence's extra_ids[e] holds it, else -1 (unscorable)."""
    out = labels if t2d is None else t2d[labels]
    if extra_ids is None:
        return out
    match = (labels[..., None] == extra_ids[:, None, None, :]) & (extra_ids[:, None, None, :] >= 0)
    return jnp.where((out < 0) & match.any(-1), num_rows + jnp.argmax(match, axis=-1), out)


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


def dpace_weights(ce, inside, scored, alpha: float):
    """D-PACE slot weights (arXiv 2605.18810) from the drafter's own detached confidence q = exp(-CE), smoothed to
    q~ = (1 - alpha) q + alpha: w_j = sum_{m >= j} prod_{i <= m} q~_i, the expected accepted length's stake in
    slot j.  Slots inside the response but unscorable (label outside the draft vocabulary) can never be accepted
    (q~ = alpha); slots past the response end neither stop acceptance nor add to the sum.  -> [..., Q-1] weights."""
    q = (1.0 - alpha) * jnp.exp(-jax.lax.stop_gradient(ce)) + alpha
    q = jnp.where(scored, q, jnp.where(inside, alpha, 1.0))
    prefix = jnp.cumprod(q, axis=-1) * inside
    return jnp.flip(jnp.cumsum(jnp.flip(prefix, -1), -1), -1) * scored


def teacher_logits(final_hidden, final_norm, eps: float, output_head, anchors, block_size: int):
    """The target's own next-token logits for slots 1..Q-1 of every block: slot k of anchor a predicts x[a + k],
    which the target scores from its last layer's output at a + k - 1 (final norm, then the head).

    final_hidden [Bt, S, H] (hidden-state index num_layers, before the final norm), output_head [H, V] (or the
    draft vocabulary's rows) -> float32 [Bt, N, Q-1, V], no gradient (the target is frozen)."""
    pos = anchors[:, :, None] + jnp.arange(block_size - 1)[None, None, :]  # a + k - 1 for k = 1..Q-1
    pos = jnp.minimum(pos, final_hidden.shape[1] - 1)
    h = final_hidden[jnp.arange(final_hidden.shape[0])[:, None, None], pos]  # [Bt, N, Q-1, H]
    h = rms_norm(h, final_norm, eps)
    return jax.lax.stop_gradient(jnp.einsum("bnkd,dv->bnkv", h, output_head, preferred_element_type=jnp.float32))


def dflash_loss(weights: DFlashWeights, cfg: DrafterConfig, embed, output_head, tokens, taps, loss_mask, lengths,
                anchors, keep, block_size: int, gamma: float, t2d=None, dpace_alpha: float | None = None,
                teacher=None, distill: float = 0.0, extra=None):
    """Weighted cross-entropy (sum w * CE / sum w) and unweighted accuracy / per-slot accuracy over the mask.

    With a draft vocabulary, `output_head` holds its rows [H, V_d] and `t2d` [V] maps target ids to draft
    indices (-1 outside): labels outside the draft vocabulary get no loss and count as misses in the accuracy.
    `dpace_alpha`: weight slots by D-PACE (`dpace_weights`) instead of the fixed exp(-(k-1)/gamma) decay.
    `teacher` [Bt, N, Q-1, V(_d)] (`teacher_logits`) with `distill` in (0, 1]: each slot's loss becomes
    (1 - distill) * CE(label) + distill * KL(softmax(teacher) || drafter), the target's whole next-token
    distribution (over the draft vocabulary when there is one) as a soft label, under the same slot weights.
    `extra` (`block_logits`): each sequence's context-vocabulary ids are scored beside the draft vocabulary, so
    their labels are trained too (not with `teacher`, whose distribution covers the draft vocabulary only).
    """
    if extra is not None and teacher is not None:
        raise ValueError("distillation covers the draft vocabulary only: train a context vocabulary without it")
    logits = block_logits(weights, cfg, embed, output_head, tokens, taps, anchors, keep, block_size, extra)
    labels, w = labels_and_weights(tokens, loss_mask, lengths, anchors, keep, block_size, gamma)
    valid = (w > 0).astype(jnp.float32)
    if t2d is not None or extra is not None:
        labels = scored_labels(labels, t2d, None if extra is None else extra[0], output_head.shape[1])
        w = jnp.where(labels >= 0, w, 0.0)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    ce = logz - target
    if dpace_alpha is not None:
        w = dpace_weights(ce, valid > 0, w > 0, dpace_alpha)
    per_slot_loss = ce
    if teacher is not None and distill > 0.0:
        log_p = jax.nn.log_softmax(teacher, axis=-1)
        kl = jnp.sum(jnp.exp(log_p) * (log_p - (logits - logz[..., None])), axis=-1)
        per_slot_loss = (1.0 - distill) * ce + distill * kl
    loss = (w * per_slot_loss).sum() / (w.sum() + 1e-6)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32) * valid
    per_slot = correct.sum((0, 1)) / jnp.maximum(valid.sum((0, 1)), 1.0)
    return loss, {"acc": correct.sum() / jnp.maximum(valid.sum(), 1.0), "acc_per_slot": per_slot,
                  "num_labels": valid.sum()}


def simulated_acceptance(weights: DFlashWeights, cfg: DrafterConfig, embed, output_head, tokens, taps, loss_mask,
                         lengths, anchors, keep, block_size: int, t2d=None, extra=None):
    """Teacher-forced speculative acceptance: for each anchor, the number of leading slots whose argmax equals
    the target's own next tokens (greedy answers), i.e. what verification would accept with a block drafted
    from the true context (`extra`: with each sequence's context vocabulary, as the engine drafts).
    -> (accepted [Bt, N] int32, counted [Bt, N] bool: anchors with a full block inside the response)."""
    logits = block_logits(weights, cfg, embed, output_head, tokens, taps, anchors, keep, block_size, extra)
    labels, w = labels_and_weights(tokens, loss_mask, lengths, anchors, keep, block_size, 1.0)
    if t2d is not None or extra is not None:
        labels = scored_labels(labels, t2d, None if extra is None else extra[0], output_head.shape[1])
    hit = (jnp.argmax(logits, -1) == labels) & (w > 0)
    accepted = jnp.cumprod(hit.astype(jnp.int32), axis=-1).sum(-1)
    return accepted, (w > 0).all(-1)
