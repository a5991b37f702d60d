"""EAGLE-3 training-time test (TTT) objective as pure functions.

Row (p, step k) stands for the k-th drafted row of a chain that started after real position p - k: its input
token is x[p+1], its hidden input is the target feature fc(taps[p]) at step 0 and the drafter's own pre-norm
output of row (p - 1, k - 1) afterwards; it predicts x[p+2].  It attends to the step-0 (real) keys at positions
<= p - k and to one "diagonal" key per earlier step t = 1..k, the key of row (p - k + t, t), exactly the keys the
inference chain (drafter/eagle3.py `propose`) has at that point.  Loss: cross-entropy over the draft vocabulary
(labels outside it are masked), steps weighted 0.8^k.  Labels are the regenerated tokens, which the target
produced greedily, i.e. the argmax of the target distribution the paper's soft loss uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafter.eagle3 import Eagle3Config, Eagle3Weights, finish_layer, layer_inputs, qkv
from specjax.model.layers import MASK_VALUE


def shift_right(x: jax.Array, n: int) -> jax.Array:
    """x[:, p] -> x[:, p - n] along axis 1 (zeros enter on the left)."""
    if n == 0:
        return x
    pad = jnp.zeros_like(x[:, :n])
    return jnp.concatenate([pad, x[:, :-n]], axis=1)


def ttt_logits(w: Eagle3Weights, cfg: Eagle3Config, embed, tokens, taps, steps: int = 7) -> list[jax.Array]:
    """Draft-vocabulary logits [Bt, S, Vd] of every row (p, k), one array per step k."""
    bt, s = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(s)[None], (bt, s))
    emb = embed[jnp.concatenate([tokens[:, 1:], jnp.zeros((bt, 1), tokens.dtype)], axis=1)]  # token x[p+1]
    hidden = taps @ w.fc
    g = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5
    keys, values, out_logits = [], [], []
    for k in range(steps):
        x, residual = layer_inputs(w, cfg, emb, hidden)
        q, kk, vv = qkv(w, cfg, x, pos)
        keys.append(kk)
        values.append(vv)
        qg = q.reshape(bt, s, cfg.num_kv_heads, g, cfg.head_dim)
        s_real = jnp.einsum("bqkgd,bjkd->bkgqj", qg, keys[0], preferred_element_type=jnp.float32) * scale
        real_vis = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None] - k  # key j <= p - k
        s_real = jnp.where(real_vis[None, None, None], s_real, MASK_VALUE)
        m = s_real.max(-1, keepdims=True)
        if k:
            dk = jnp.stack([shift_right(keys[t], k - t) for t in range(1, k + 1)], axis=2)  # [Bt, S, k, K, D]
            dv = jnp.stack([shift_right(values[t], k - t) for t in range(1, k + 1)], axis=2)
            s_diag = jnp.einsum("bqkgd,bqtkd->bkgqt", qg, dk, preferred_element_type=jnp.float32) * scale
            m = jnp.maximum(m, s_diag.max(-1, keepdims=True))
        p_real = jnp.exp(s_real - m)
        den = p_real.sum(-1, keepdims=True)
        o = jnp.einsum("bkgqj,bjkd->bqkgd", p_real, values[0])
        if k:
            p_diag = jnp.exp(s_diag - m)
            den = den + p_diag.sum(-1, keepdims=True)
            o = o + jnp.einsum("bkgqt,bqtkd->bqkgd", p_diag, dv)
        o = o / den.transpose(0, 3, 1, 2, 4)  # [Bt, S, K, G, D]
        out, normed = finish_layer(w, cfg, o.reshape(bt, s, -1), residual)
        out_logits.append(jnp.einsum("bsd,dv->bsv", normed, w.lm_head, preferred_element_type=jnp.float32))
        hidden = shift_right(out, 1)  # row (p, k+1) receives the output of row (p - 1, k)
    return out_logits


def ttt_loss(w: Eagle3Weights, cfg: Eagle3Config, embed, tokens, taps, loss_mask, lengths, target_to_draft,
             steps: int = 7, decay: float = 0.8):
    """-> (loss, aux) for tokens [Bt, S], taps [Bt, S, 3Ht]; target_to_draft [V] maps target ids to draft ids
    (-1 outside the draft vocabulary)."""
    bt, s = tokens.shape
    pos = jnp.arange(s)[None, :]
    labels = jnp.concatenate([tokens[:, 2:], jnp.zeros((bt, 2), tokens.dtype)], axis=1)  # x[p+2]
    label_idx = target_to_draft[labels]
    mask_next2 = jnp.concatenate([loss_mask[:, 2:], jnp.zeros((bt, 2), bool)], axis=1)
    base_valid = (pos + 2 < lengths[:, None]) & mask_next2 & (label_idx >= 0)
    total, accs = 0.0, []
    for k, logits in enumerate(ttt_logits(w, cfg, embed, tokens, taps, steps)):
        vf = (base_valid & (pos - k >= 0)).astype(jnp.float32)
        ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, jnp.maximum(label_idx, 0)[..., None],
                                                                 -1)[..., 0]
        total = total + decay ** k * (ce * vf).sum() / jnp.maximum(vf.sum(), 1.0)
        accs.append(((jnp.argmax(logits, -1) == label_idx) * vf).sum() / jnp.maximum(vf.sum(), 1.0))
    norm = sum(decay ** k for k in range(steps))
    return total / norm, {"acc": accs[0], "acc_per_slot": jnp.stack(accs)}


def ttt_acceptance(w: Eagle3Weights, cfg: Eagle3Config, embed, tokens, taps, loss_mask, lengths, anchors, keep,
                   target_to_draft, steps: int):
    """Teacher-forced acceptance of the EAGLE-3 chain, the counterpart of DFlash's `simulated_acceptance`.

    At anchor a (x[a] the bonus token, target taps through a - 1) the inference chain's step k is TTT row
    (a - 1 + k, k) and drafts x[a + 1 + k]; while the drafts match, the tokens it was fed are the true ones, so
    the leading matches are what verification would accept.  -> (accepted [Bt, N] int32, counted [Bt, N] bool:
    anchors whose `steps` drafts all fall inside the response)."""
    bt, s = tokens.shape
    preds = jnp.stack([jnp.argmax(x, -1) for x in ttt_logits(w, cfg, embed, tokens, taps, steps)], -1)
    k = jnp.arange(steps)[None, None, :]
    rows = anchors[:, :, None] - 1 + k  # [Bt, N, steps]: the TTT row of chain step k
    label_pos = anchors[:, :, None] + 1 + k
    inside = (label_pos < lengths[:, None, None]) & (rows >= 0) & keep[..., None]
    flat = (jnp.clip(rows, 0, s - 1) * steps + k).reshape(bt, -1)
    pred = jnp.take_along_axis(preds.reshape(bt, -1), flat, axis=1).reshape(rows.shape)
    safe = jnp.where(label_pos < s, label_pos, 0).reshape(bt, -1)
    labels = jnp.take_along_axis(tokens, safe, axis=1).reshape(rows.shape)
    resp = jnp.take_along_axis(loss_mask, safe, axis=1).reshape(rows.shape) & inside
    hit = (pred == target_to_draft[labels]) & resp
    return jnp.cumprod(hit.astype(jnp.int32), axis=-1).sum(-1), resp.all(-1)
