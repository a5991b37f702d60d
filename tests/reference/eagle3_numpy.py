"""A plain numpy (float64) statement of EAGLE-3 drafting, written from the architecture description rather than
from our JAX code: per-row loops, explicit GQA head mapping, no pages, no caches reused between calls."""

import numpy as np


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv
    cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rot * sin


def silu(x):
    return x / (1 + np.exp(-x))


def row_qkv(w, cfg, emb, hidden, pos):
    e = rms(emb, w["input_norm"], cfg.rms_norm_eps)
    if cfg.norm_before_residual:
        h = rms(hidden, w["hidden_norm"], cfg.rms_norm_eps)
        residual = h
    else:
        residual = hidden
        h = rms(hidden, w["hidden_norm"], cfg.rms_norm_eps)
    x = np.concatenate([e, h])
    q = (x @ w["w_q"]).reshape(cfg.num_heads, cfg.head_dim)
    kv = x @ w["w_kv"]
    k = kv[: kv.size // 2].reshape(cfg.num_kv_heads, cfg.head_dim)
    v = kv[kv.size // 2:].reshape(cfg.num_kv_heads, cfg.head_dim)
    return np.stack([rope(qh, pos, cfg.rope_theta) for qh in q]), np.stack([rope(kh, pos, cfg.rope_theta)
                                                                           for kh in k]), v, residual


def attend(cfg, q, keys, values):
    group = cfg.num_heads // cfg.num_kv_heads
    out = []
    for n in range(cfg.num_heads):
        kk = np.stack([k[n // group] for k in keys])
        vv = np.stack([v[n // group] for v in values])
        s = kk @ q[n] / np.sqrt(cfg.head_dim)
        p = np.exp(s - s.max())
        out.append((p / p.sum()) @ vv)
    return np.concatenate(out)


def finish(w, cfg, o, residual):
    residual = residual + o @ w["w_o"]
    n = rms(residual, w["post_norm"], cfg.rms_norm_eps)
    gate, up = np.split(n @ w["w_gate_up"], 2)
    residual = residual + (silu(gate) * up) @ w["w_down"]
    return residual, rms(residual, w["norm"], cfg.rms_norm_eps)


def draft(weights, cfg, embed, taps, tokens, k, forced=None, return_logits=False):
    """Drafts after tokens[-1] (the bonus at position s = len(tokens) - 1), given target taps of positions < s.
    `forced`: feed these tokens into the chain instead of the drafts (teacher forcing, as in TTT)."""
    w = {f: np.asarray(getattr(weights, f), np.float64) for f in
         ("fc", "hidden_norm", "input_norm", "w_q", "w_kv", "w_o", "post_norm", "w_gate_up", "w_down", "norm",
          "lm_head")}
    d2t = None if weights.d2t is None else np.asarray(weights.d2t)
    embed = np.asarray(embed, np.float64)
    s = len(tokens) - 1
    keys, values = [], []
    last = None
    for p in range(s):  # real rows: (feature at p, token at p + 1)
        feat = np.asarray(taps[p], np.float64) @ w["fc"]
        q, kk, vv, residual = row_qkv(w, cfg, embed[tokens[p + 1]], feat, p)
        keys.append(kk)
        values.append(vv)
        last = (q, residual)
    out, logits, hidden = [], [], None
    q, residual = last
    for j in range(k):
        if j > 0:
            tok = forced[j - 1] if forced is not None else out[-1]
            q, kk, vv, residual = row_qkv(w, cfg, embed[tok], hidden, s - 1 + j)
            keys.append(kk)
            values.append(vv)
        hidden, normed = finish(w, cfg, attend(cfg, q, keys, values), residual)
        logits.append(normed @ w["lm_head"])
        idx = int(np.argmax(logits[-1]))
        out.append(idx + int(d2t[idx]) if d2t is not None else idx)
    return (out, logits) if return_logits else out
