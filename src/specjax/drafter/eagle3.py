"""EAGLE-3 drafter (baseline): one decoder layer over [input_layernorm(embedding), hidden_norm(feature)], drafting
K tokens autoregressively by feeding its own hidden state back.

Shapes and conventions follow SafeAILab/EAGLE and vLLM's `llama_eagle3.py`:
* features = fc(concat of the target hidden states ENTERING layers aux ids, default 2, N//2, N-3), [3Ht] -> [H];
  the drafter's own hidden states are fed back as they are (fc only applies to target features);
* the row at position p pairs the hidden state at p with the token at p + 1 (the token that hidden state chose)
  and predicts the token at p + 2;
* residual stream = the (un-normed) feature; attention reads 2H-wide inputs; the pre-norm output is what the next
  chain step receives, the normed output goes through the drafter's LM head over its draft vocabulary, mapped to
  target ids by `target = i + d2t[i]`.

Paged state (same page tables and slots as the target): K, V of every accepted position and its fused feature
(needed to restart the chain from the last accepted position).  `observe` produces those rows; `propose`
recomputes the last accepted row and then runs K - 1 chain rows whose K/V live only inside the call (no
rollback needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from specjax.model.attention import pages_and_new_attention
from specjax.model.layers import apply_rope, rms_norm, rope_cos_sin, swiglu
from specjax.sampling import first_argmax


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    aux_hidden_state_ids: tuple[int, ...]  # HF hidden_states indices = inputs of these target layers
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    norm_before_residual: bool = False

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        return self.aux_hidden_state_ids

    def inv_freq(self):
        import numpy as np

        return (1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
                ).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Eagle3Weights:
    fc: jax.Array  # [3 * Ht, H]
    hidden_norm: jax.Array  # [H]
    input_norm: jax.Array  # [H]
    w_q: jax.Array  # [2H, N * D]
    w_kv: jax.Array  # [2H, 2 * K * D]
    w_o: jax.Array  # [N * D, H]
    post_norm: jax.Array  # [H]
    w_gate_up: jax.Array  # [H, 2F]
    w_down: jax.Array  # [F, H]
    norm: jax.Array  # [H]
    lm_head: jax.Array  # [H, Vd]
    d2t: jax.Array | None  # [Vd] int32 offsets (target id = i + d2t[i]); None when Vd == V


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EagleCache:
    """Paged EAGLE-3 state (pools [K, P, Z, D] / [1, P, Z, H]) or, with the same fields, one step's rows."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    feat: tuple[jax.Array, ...]


def init_cache(cfg: Eagle3Config, num_pages: int, page_size: int, dtype=jnp.float32) -> EagleCache:
    kv = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    return EagleCache(k=(jnp.zeros(kv, dtype),), v=(jnp.zeros(kv, dtype),),
                      feat=(jnp.zeros((1, num_pages, page_size, cfg.hidden_size), dtype),))


def layer_inputs(w: Eagle3Weights, cfg: Eagle3Config, emb, hidden):
    """-> (2H attention input, residual) from token embeddings and features/hidden states [B, T, H]."""
    e = rms_norm(emb, w.input_norm, cfg.rms_norm_eps)
    if cfg.norm_before_residual:
        h = rms_norm(hidden, w.hidden_norm, cfg.rms_norm_eps)
        residual = h
    else:
        residual = hidden
        h = rms_norm(hidden, w.hidden_norm, cfg.rms_norm_eps)
    return jnp.concatenate([e, h], axis=-1), residual


def qkv(w: Eagle3Weights, cfg: Eagle3Config, x, positions):
    b, t, _ = x.shape
    cos, sin = rope_cos_sin(positions, jnp.asarray(cfg.inv_freq()))
    q = apply_rope((x @ w.w_q).reshape(b, t, cfg.num_heads, cfg.head_dim), cos, sin)
    k, v = jnp.split(x @ w.w_kv, 2, axis=-1)
    k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
    return q, k, v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)


def finish_layer(w: Eagle3Weights, cfg: Eagle3Config, attn_out, residual):
    """Attention output -> (pre-norm hidden fed back to the chain, normed hidden for the LM head)."""
    b, t = attn_out.shape[:2]
    residual = residual + attn_out.reshape(b, t, -1) @ w.w_o
    residual = residual + swiglu(rms_norm(residual, w.post_norm, cfg.rms_norm_eps), w.w_gate_up, w.w_down)
    return residual, rms_norm(residual, w.norm, cfg.rms_norm_eps)


def draft_logits_to_target(w: Eagle3Weights, normed):
    """Greedy draft token in TARGET ids: argmax over the draft vocabulary, then d2t."""
    idx = first_argmax(jnp.einsum("...d,dv->...v", normed, w.lm_head, preferred_element_type=jnp.float32))
    return (idx + w.d2t[idx] if w.d2t is not None else idx).astype(jnp.int32)


def observe(w: Eagle3Weights, cfg: Eagle3Config, embed, taps, positions, next_tokens) -> EagleCache:
    """Rows for processed positions: K/V of (feature at p, token at p + 1) and the fused feature itself."""
    feat = taps @ w.fc  # [B, T, H]
    x, _ = layer_inputs(w, cfg, embed[jnp.maximum(next_tokens, 0)], feat)
    _, k, v = qkv(w, cfg, x, positions)
    return EagleCache(k=(k,), v=(v,), feat=(feat[:, :, None, :],))


def propose(w: Eagle3Weights, cfg: Eagle3Config, cache: EagleCache, embed, bonus, start, page_table,
            num_draft: int, kernel: str | None = None):
    """K drafts after `bonus` (at position `start`).  Row 1 recomputes position start - 1 from its stored
    feature and the bonus; rows 2..K feed the previous row's pre-norm hidden and draft token back.  `kernel`: the
    target's in-place paged-attention kernel (TargetWeights.attention_kernel), if any."""
    b = bonus.shape[0]
    z = cache.k[0].shape[2]
    last = start - 1  # the last accepted position; its K/V and feature are in the cache
    slot_page = jnp.take_along_axis(page_table, (last // z)[:, None], axis=1)[:, 0]
    hidden = cache.feat[0][0, slot_page, last % z][:, None, :]  # [B, 1, H]
    token = bonus
    chain_k, chain_v, drafts = [], [], []
    for j in range(num_draft):
        pos = (last + j)[:, None]
        x, residual = layer_inputs(w, cfg, embed[token][:, None, :], hidden)
        q, k, v = qkv(w, cfg, x, pos)
        if j > 0:  # row 1's own K/V are already cached; chain rows' are not
            chain_k.append(k)
            chain_v.append(v)
        if chain_k:
            kn, vn = jnp.concatenate(chain_k, axis=1), jnp.concatenate(chain_v, axis=1)
        else:  # no chain rows yet: one fully masked dummy key keeps the shapes uniform
            kn, vn = jnp.zeros_like(k), jnp.zeros_like(v)
        new_visible = jnp.full((b, 1, kn.shape[1]), bool(chain_k))
        o = pages_and_new_attention(q, cache.k[0], cache.v[0], page_table, start, kn, vn, new_visible,  # <= start-1
                                    cfg.head_dim ** -0.5, kernel)
        hidden, normed = finish_layer(w, cfg, o, residual)
        token = draft_logits_to_target(w, normed[:, 0])
        drafts.append(token)
    return jnp.stack(drafts, axis=1)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Eagle3Params:
    """What the EAGLE-3 proposer needs on the device: its weights and the target's embedding (by reference)."""

    drafter: Eagle3Weights
    embed: jax.Array  # [V, H], the target's table
