"""DFlash drafter forward: fused target context injected as extra K/V, non-causal block attention.

Two pure functions over the drafter's own paged K/V (same page tables and slots as the target, one pool per
drafter layer):

* `observe`  projects target hidden-state taps (fc -> hidden_norm -> k/v per layer) into K/V rows that the
  caller writes into the drafter pages at the slots of ACCEPTED positions only.  Rejected positions get slot -1
  and are never written (the "sequence-length inflation" bug of tpu-inference #1869 cannot happen).
* `propose`  runs the block [bonus, MASK x (Q-1)] at positions s..s+Q-1.  Queries come from the block only;
  keys are the cached context (positions < s) plus the block itself, with no causal mask.  Block K/V are never
  stored, so there is nothing to roll back.  Slot k predicts the token AT position s+k (same-position labels).

Two optional specjax extensions of the z-lab format (absent from z-lab checkpoints, which run unchanged):
* `slot_embedding` [Q, H], added to the input row of block slot k: every slot knows its offset (without it the
  MASK slots differ only through RoPE, and a small drafter confuses offsets).
* `draft_ids` [V_d]: a draft vocabulary (sorted target ids).  Drafts are argmax over those rows of the target's
  output head only (`draft_head` [V_d, H], cut once from the target head by `with_draft_head`: its GGUF blocks
  when the target head runs on the CPU kernels), then mapped back to target ids.  Tokens outside it are never
  drafted, which costs acceptance only when the target writes them.  Most such tokens in an answer are copied
  from its prompt (names, identifiers): `propose_tokens` also scores a few context tokens per sequence
  (`extra_ids`, the engine's EngineConfig.context_vocab) and drafts one wherever it beats the draft vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import DrafterConfig
from specjax.model.attention import KVRows, pages_and_new_attention
from specjax.model.layers import apply_rope, kept, rms_norm, rope_cos_sin, swiglu
from specjax.model.quant import bf16_matrix, head_product, linear, q8_0_matrix, take_rows
from specjax.model.target import KVPages
from specjax.sampling import first_argmax, vocab_major_argmax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DrafterLayer:
    attn_norm: jax.Array  # [H]
    w_q: jax.Array  # [H, N * Dh]
    w_kv: jax.Array  # [H, 2 * K * Dh]: k and v fused (shared by context rows and block rows)
    q_norm: jax.Array  # [Dh]
    k_norm: jax.Array  # [Dh]
    w_o: jax.Array  # [N * Dh, H]
    mlp_norm: jax.Array  # [H]
    w_gate_up: jax.Array  # [H, 2F]
    w_down: jax.Array  # [F, H]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DFlashWeights:
    fc: jax.Array  # [C * Ht, H]: fuses the C concatenated target taps
    hidden_norm: jax.Array  # [H]
    layers: tuple[DrafterLayer, ...]
    norm: jax.Array  # [H]
    mask_embedding: jax.Array | None  # [H] drafter-owned mask embedding, or None (use embed[mask_token_id])
    slot_embedding: jax.Array | None = None  # [Q, H] added to block slot k's input row, or None
    draft_ids: jax.Array | None = None  # [V_d] int32 sorted target ids of the draft vocabulary, or None (all)
    draft_head: jax.Array | None = None  # [V_d, H] those rows of the target head (derived, never saved)


def with_draft_head(weights: DFlashWeights, vocab_rows) -> DFlashWeights:
    """Cut the draft vocabulary's rows out of the target's head rows [V, H] (an array, or a QuantMatrix:
    TargetWeights.head_matrix) once (no-op without a draft vocabulary)."""
    if weights.draft_ids is None or weights.draft_head is not None:
        return weights
    return dataclasses.replace(weights, draft_head=take_rows(vocab_rows, weights.draft_ids))


def with_bf16_kernel(weights: DFlashWeights, kernel: str) -> DFlashWeights:
    """Once per engine on specjax's CPU kernels: every drafter matrix whose float32 values are all bfloat16 numbers
    (a bfloat16 checkpoint) also kept as those bits for the BF16 kernel `kernel` (quant.bf16_matrix, transposed
    to [out, in]): a drafter step streams half the bytes of its weights, which are the same weights."""
    return on_kernel(weights, lambda w: bf16_matrix(w, kernel))


def with_q8_0_kernel(weights: DFlashWeights, kernel: str) -> DFlashWeights:
    """Once per engine beside an integer-activation target: every drafter matrix quantized as Q8_0 for the int8 kernel
    `kernel` (quant.q8_0_matrix; ~1.06 bytes a weight, and the products of the target's layers)."""
    return on_kernel(weights, lambda w: q8_0_matrix(w, kernel))


def on_kernel(weights: DFlashWeights, matrix) -> DFlashWeights:
    """The drafter's fc and each layer's five matrices through `matrix` (a float [out, in] host array -> a
    QuantMatrix, or None to keep that matrix on XLA)."""

    def streamed(w):
        q = matrix(np.asarray(w).T)  # transposed on the host (an eager transpose compiles per shape)
        return w if q is None else q

    names = ("w_q", "w_kv", "w_o", "w_gate_up", "w_down")
    layers = tuple(dataclasses.replace(layer, **{n: streamed(getattr(layer, n)) for n in names})
                   for layer in weights.layers)
    return dataclasses.replace(weights, fc=streamed(weights.fc), layers=layers)


def output_rows(weights: DFlashWeights, vocab_rows):
    """The head rows [V_d, H] drafts are scored with: the draft vocabulary's if any, else the target's."""
    if weights.draft_ids is None:
        return vocab_rows
    if weights.draft_head is None:
        raise ValueError("a drafter with a draft vocabulary needs with_draft_head() before it proposes")
    return weights.draft_head


def to_target_ids(weights: DFlashWeights, idx: jax.Array) -> jax.Array:
    """Argmax indices over `output_rows` -> target token ids."""
    return idx if weights.draft_ids is None else weights.draft_ids[idx]


def fuse_context(weights: DFlashWeights, cfg: DrafterConfig, taps: jax.Array) -> jax.Array:
    """ctx_feat = hidden_norm(concat(taps) @ fc): computed once per token, shared by every layer.  [..., H]"""
    return rms_norm(linear(taps, weights.fc), weights.hidden_norm, cfg.rms_norm_eps)


def layer_kv(layer: DrafterLayer, cfg: DrafterConfig, x: jax.Array, cos, sin):
    """K (k_norm + RoPE) and V of rows x [B, T, H] -> ([B, T, K, Dh], [B, T, K, Dh])."""
    b, t, _ = x.shape
    k, v = jnp.split(linear(x, layer.w_kv), 2, axis=-1)
    k = rms_norm(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), layer.k_norm, cfg.rms_norm_eps)
    return apply_rope(k, cos, sin), v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)


def observe(weights: DFlashWeights, cfg: DrafterConfig, taps: jax.Array, positions: jax.Array) -> KVRows:
    """Context K/V rows for taps [B, C, F*Ht] at `positions` [B, C], one [B, C, K, Dh] pair per drafter layer."""
    ctx = fuse_context(weights, cfg, taps)  # [B, C, H]
    cos, sin = rope_cos_sin(positions, jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))
    rows = [layer_kv(layer, cfg, ctx, cos, sin) for layer in weights.layers]
    return KVRows(k=tuple(k for k, _ in rows), v=tuple(v for _, v in rows))


def block_embeddings(weights: DFlashWeights, cfg: DrafterConfig, embed: jax.Array, first: jax.Array,
                     block_size: int) -> jax.Array:
    """Input rows of blocks [first, MASK x (Q-1)]: first [...] -> [..., Q, H] (target table; the drafter-owned
    mask row and per-slot embeddings if it has them)."""
    masks = jnp.full(first.shape + (block_size - 1,), cfg.mask_token_id, first.dtype)
    x = embed[jnp.concatenate([first[..., None], masks], axis=-1)]
    if weights.mask_embedding is not None:
        is_mask = (jnp.arange(block_size) > 0)[:, None]
        x = jnp.where(is_mask, weights.mask_embedding.astype(x.dtype), x)
    if weights.slot_embedding is not None:
        x = x + weights.slot_embedding[:block_size].astype(x.dtype)
    return x


def block_hidden(weights: DFlashWeights, cfg: DrafterConfig, dkv: KVPages, x: jax.Array, block_pos: jax.Array,
                 context_lens: jax.Array, page_table: jax.Array, kernel: str | None = None) -> jax.Array:
    """Drafter stack over block rows x [B, Q, H] at block_pos [B, Q]; context = cached rows < context_lens [B].
    `kernel`: the target's in-place paged-attention kernel (TargetWeights.attention_kernel), if any.

    Returns final-normed hidden states [B, Q, H].
    """
    b, q_len, _ = x.shape
    cos, sin = rope_cos_sin(block_pos, jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))
    block_visible = jnp.ones((b, q_len, q_len), bool)  # non-causal inside the block
    for i, layer in enumerate(weights.layers):
        xn = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q = rms_norm(linear(xn, layer.w_q).reshape(b, q_len, cfg.num_heads, cfg.head_dim), layer.q_norm,
                     cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kb, vb = layer_kv(layer, cfg, xn, cos, sin)
        o = pages_and_new_attention(q, dkv.k[i], dkv.v[i], page_table, context_lens, kb, vb, block_visible,
                                    cfg.head_dim ** -0.5, kernel)
        x = x + linear(o.reshape(b, q_len, -1), layer.w_o)
        x = x + swiglu(rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer.w_gate_up, layer.w_down)
    return rms_norm(x, weights.norm, cfg.rms_norm_eps)


def draft_hidden(weights: DFlashWeights, cfg: DrafterConfig, dkv: KVPages, embed: jax.Array, bonus: jax.Array,
                 context_lens: jax.Array, page_table: jax.Array, num_draft_tokens: int, block_size: int,
                 kernel: str | None = None) -> jax.Array:
    """Final-normed hidden states [B, K, H] of block slots 1..K; bonus sits at position context_lens (= s, the
    number of positions already in the drafter context)."""
    block_pos = context_lens[:, None] + jnp.arange(block_size)[None, :]  # [B, Q]
    x = block_embeddings(weights, cfg, embed, bonus, block_size)
    return block_hidden(weights, cfg, dkv, x, block_pos, context_lens, page_table, kernel)[:, 1:1 + num_draft_tokens]


def draft_scores(weights: DFlashWeights, cfg: DrafterConfig, dkv: KVPages, embed: jax.Array, vocab_rows: jax.Array,
                 bonus: jax.Array, context_lens: jax.Array, page_table: jax.Array, num_draft_tokens: int,
                 block_size: int, kernel: str | None = None) -> jax.Array:
    """Vocab-major float32 logits [V_d, B * K] of block slots 1..K through the TARGET's head rows `vocab_rows`
    [V, H] (its draft-vocabulary rows if the drafter has one: `to_target_ids` maps argmax indices back; a
    QuantMatrix streams its blocks through the CPU kernel).  Vocab-major (`head_product`): argmax runs over axis
    0 without a transpose."""
    h = draft_hidden(weights, cfg, dkv, embed, bonus, context_lens, page_table, num_draft_tokens, block_size, kernel)
    return head_product(output_rows(weights, vocab_rows), h.reshape(-1, h.shape[-1]))


def propose_logits(weights: DFlashWeights, cfg: DrafterConfig, dkv: KVPages, embed: jax.Array,
                   vocab_rows: jax.Array, bonus: jax.Array, context_lens: jax.Array, page_table: jax.Array,
                   num_draft_tokens: int, block_size: int) -> jax.Array:
    """`draft_scores` as logits [B, K, V_d] (the oracles' view)."""
    scores = draft_scores(weights, cfg, dkv, embed, vocab_rows, bonus, context_lens, page_table, num_draft_tokens,
                          block_size)
    return kept(scores).T.reshape(bonus.shape[0], num_draft_tokens, -1)


def propose_tokens(weights: DFlashWeights, cfg: DrafterConfig, dkv: KVPages, embed: jax.Array,
                   vocab_rows: jax.Array, bonus: jax.Array, context_lens: jax.Array, page_table: jax.Array,
                   num_draft_tokens: int, block_size: int, kernel: str | None = None,
                   argmax_kernel: str | None = None, extra_ids: jax.Array | None = None,
                   extra_rows: jax.Array | None = None) -> jax.Array:
    """Greedy drafts [B, K] (target ids): argmax of `draft_scores` (on `argmax_kernel`, TargetWeights').

    `extra_ids` [B, E] (target ids outside the draft vocabulary, -1 = none) with `extra_rows` [V, H] (the target
    head's rows as an array, TargetWeights.vocab_rows): each sequence's drafts are the argmax over the draft
    vocabulary and its own extra ids together, the extra scores an XLA product of E rows (E is small).  An extra
    id wins only by a strictly larger score.  Where the head runs on the int8-activation kernel its scores round
    the activations and the extra ones do not, so a near-tie may go either way: drafts only, verification decides."""
    h = draft_hidden(weights, cfg, dkv, embed, bonus, context_lens, page_table, num_draft_tokens, block_size, kernel)
    flat = h.reshape(-1, h.shape[-1])
    scores = head_product(output_rows(weights, vocab_rows), flat)
    idx = vocab_major_argmax(scores, argmax_kernel)  # [B * K]
    drafts = to_target_ids(weights, idx).reshape(bonus.shape[0], num_draft_tokens)
    if extra_ids is None or extra_ids.shape[1] == 0:
        return drafts
    best = jnp.take_along_axis(scores, idx[None, :], axis=0)[0].reshape(drafts.shape)  # the draft vocabulary's max
    rows = extra_rows[jnp.maximum(extra_ids, 0)].astype(h.dtype)  # [B, E, H]
    extra = jnp.einsum("bkh,beh->bke", h, rows, preferred_element_type=jnp.float32)
    extra = jnp.where(extra_ids[:, None, :] >= 0, extra, -jnp.inf)
    j = first_argmax(extra, axis=-1)  # [B, K]
    top = jnp.take_along_axis(extra, j[..., None], axis=-1)[..., 0]
    return jnp.where(top > best, jnp.take_along_axis(extra_ids, j, axis=1), drafts)
