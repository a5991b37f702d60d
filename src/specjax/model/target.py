"""Target decoder (Llama / Qwen2 / Qwen3) as pure functions over registered dataclass pytrees.

One forward serves prefill and verification: a batch of sequences, each with a run of T new tokens at given
absolute positions, writes its K/V into the paged cache and returns the final hidden states plus the hidden
states at requested `output_hidden_states` indices (0 = embeddings, i = OUTPUT of decoder layer i - 1, before
the final norm).  Layers are unrolled over per-layer arrays: on XLA:CPU this is ~2x faster than lax.scan over
stacked weights at decode shapes (see ../shared/docs/assets.md §9.3).

Layout: weights are stored [out, in] (as HF stores them) and the residual stream runs feature-major, x [D, M]
for the M = B * T tokens of a step, so every projection is `W @ x` with the large dimension first.  On XLA:CPU
(YNNPACK dots) this is what keeps a verify step of q tokens close to the cost of one: the same products written
token-major (`x @ W[in, out]`) cost 1.5-2x more at q = 4..16 (docs/results/kflat.md); on accelerators the
layout is free.  Attention and the outputs are token-major; only those small activations are transposed.

Tensor parallelism (specjax/parallel.py) shards the fused q/k/v and gate/up rows, w_o and w_down columns, the KV
pools' head axis and the vocabulary over `cfg.tensor_parallel` devices; the fused rows are stored grouped by
shard (`fused_row_order`) so that each device's slice holds whole heads and its own gate and up rows.  The code
is the same for every degree (one group = HF order); XLA inserts the two all-reduces per layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.model.attention import KVRows, PoolView, paged_attention, reads_pages_in_place
from specjax.model.layers import apply_rope, kept, rms_norm, rope_cos_sin
from specjax.model.quant import QuantMatrix, head_product, matmul
from specjax.model.stack import first_layer
from specjax.sampling import vocab_major_argmax


def fused_row_order(part_sizes: tuple[int, ...], shards: int) -> np.ndarray:
    """Row order of a fused projection for `shards`-way tensor parallelism: HF row indices, shard by shard, each
    shard holding its slice of every part (q heads, k heads, v heads; or gate, up).  With one shard it is the
    identity; `np.argsort` of it restores HF order."""
    starts = np.cumsum((0,) + tuple(part_sizes))
    return np.concatenate([np.arange(start + s * size // shards, start + (s + 1) * size // shards)
                           for s in range(shards) for start, size in zip(starts, part_sizes)])


def qkv_parts(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.q_size, cfg.kv_size, cfg.kv_size


def gate_up_parts(cfg: ModelConfig) -> tuple[int, int]:
    return cfg.intermediate_size, cfg.intermediate_size


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TargetLayer:
    """The four projections are arrays, or QuantMatrix (model/quant.py) when loaded from GGUF blocks for the CPU
    kernels; either way they are multiplied by `matmul`."""

    attn_norm: jax.Array  # [D]
    w_qkv: jax.Array  # [(N + 2K) * H, D]: q, k, v projections fused, rows in fused_row_order(qkv_parts)
    b_qkv: jax.Array | None  # [(N + 2K) * H] (Qwen2) or None, same row order
    q_norm: jax.Array | None  # [H] (Qwen3) or None
    k_norm: jax.Array | None  # [H] (Qwen3) or None
    w_o: jax.Array  # [D, N * H]
    mlp_norm: jax.Array  # [D]
    w_gate_up: jax.Array  # [2F, D]: gate and up fused, rows in fused_row_order(gate_up_parts)
    w_down: jax.Array  # [D, F]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TargetWeights:
    embed: jax.Array  # [V, D]
    layers: tuple[TargetLayer, ...]  # or a LayerStack of them (model/stack.py: integer kernels, one device)
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [V, D], or None when tied to `embed`
    head_blocks: QuantMatrix | None = None  # the LM head's rows as GGUF blocks for `logits` (model/quant.py)
    # registered FFI target of the in-place paged-attention kernel (kernels/paged_attention.cc), set by the loader
    attention_kernel: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # ... and of the kernel that writes a step's K/V rows into every pool in one call (kernels/kv_write.cc)
    kv_write_kernel: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    # ... and of the greedy tokens of the head's vocab-major logits (kernels/argmax.cc)
    argmax_kernel: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def integer_products(self) -> bool:
        """Do the layers' products run on the integer-activation GGUF kernels (QuantMatrix.integer)?"""
        w = first_layer(self.layers).w_qkv
        return isinstance(w, QuantMatrix) and w.integer

    @property
    def attention_any_queries(self) -> bool:
        """Does every attention of a forward go to the kernel, prefill chunks included?  Yes on integer-activation
        GGUF kernels (QuantMatrix.integer): a row's result must not depend on its step's shape there, and XLA's
        gathered attention rounds differently with the padding."""
        return self.attention_kernel is not None and self.integer_products

    @property
    def vocab_rows(self) -> jax.Array:
        """[V, D]: the LM head's rows (the embedding when tied)."""
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def head_matrix(self):
        """The LM head's rows [V, D] as the product reads them: its GGUF blocks (QuantMatrix) when loaded for the
        kernels, else `vocab_rows`."""
        return self.vocab_rows if self.head_blocks is None else self.head_blocks

    @property
    def output_head(self) -> jax.Array:
        """[D, V] view of the LM head: the operand of the training objectives' token-major heads."""
        return self.vocab_rows.T


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVPages:
    """Paged K/V pools, one [K, P, Z, H] array per layer, or (`stacked`) one [L, K, P, Z, H] array for every layer's
    K and one for V: two step arguments instead of 2 L (see model/attention.py for the layout)."""

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2] if self.stacked else self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3] if self.stacked else self.k[0].shape[2]

    def layer(self, i: int):
        """-> (K pool, V pool) of layer i: arrays, or PoolViews into the stacks."""
        if self.stacked:
            return PoolView(self.k, i), PoolView(self.v, i)
        return self.k[i], self.v[i]


def init_kv_pages(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                  dtype=jnp.float32, stacked: bool = False) -> KVPages:
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    if stacked:
        return KVPages(k=jnp.zeros((num_layers, *shape), dtype), v=jnp.zeros((num_layers, *shape), dtype))
    return KVPages(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))


def stacks_pools(weights: TargetWeights, cfg: ModelConfig, kv_dtype) -> bool:
    """Do this target's KV pools go stacked (KVPages.stacked)?  Where the kernels do every read (the attention of
    any number of queries) and every write of them: they address a layer inside the stack; XLA would copy it out."""
    return (weights.kv_write_kernel is not None and weights.attention_any_queries
            and reads_pages_in_place(weights.attention_kernel, 1, kv_dtype, cfg.head_dim, True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardBatch:
    """Device inputs of one forward: B sequences x T new tokens (all int32)."""

    tokens: jax.Array  # [B, T]
    positions: jax.Array  # [B, T] absolute positions
    slots: jax.Array  # [B, T] flat KV slot per token (-1 = padding, not written)
    page_table: jax.Array  # [B, Pg] pages in logical order (padding entries -> scratch page 0)


def attention_block(layer: TargetLayer, cfg: ModelConfig, x, k_pool, v_pool, batch: ForwardBatch, cos, sin,
                    kernel: str | None = None, any_queries: bool = False):
    """Pre-norm attention of one layer over the pages plus the new rows.  x: [D, B*T] -> (x, k_new, v_new), the new
    rows rounded once to the pools' dtype: what this step's queries saw is what the commit writes and later steps
    read (rounded a second time from float32 in the commit's program they could differ, as under XLA's -O0, and a
    verification row then saw another key than plain decoding).  `kernel`, `any_queries`:
    TargetWeights.attention_kernel, .attention_any_queries."""
    b, t = batch.tokens.shape
    g = cfg.tensor_parallel
    xn = rms_norm(x, layer.attn_norm[:, None], cfg.rms_norm_eps, axis=0)
    qkv = matmul(layer.w_qkv, xn)  # [(N + 2K) * H, B*T], rows grouped by shard (see fused_row_order)
    if layer.b_qkv is not None:
        qkv = qkv + layer.b_qkv[:, None]
    qkv = kept(qkv).T.reshape(b, t, g, -1)
    q, k, v = jnp.split(qkv, [cfg.q_size // g, (cfg.q_size + cfg.kv_size) // g], axis=-1)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.astype(k_pool.dtype), v.astype(v_pool.dtype)
    o = paged_attention(q, k_pool, v_pool, batch.page_table, batch.positions, batch.slots >= 0, k, v,
                        cfg.head_dim ** -0.5, kernel, any_queries)
    return x + matmul(layer.w_o, o.reshape(b * t, cfg.q_size).T), k, v


def mlp_block(layer: TargetLayer, cfg: ModelConfig, x):
    """Pre-norm SwiGLU MLP, feature-major: x [D, M] -> x + down(silu(gate) * up)."""
    xn = rms_norm(x, layer.mlp_norm[:, None], cfg.rms_norm_eps, axis=0)
    gate_up = matmul(layer.w_gate_up, xn)  # rows grouped by shard
    gate_up = gate_up.reshape(cfg.tensor_parallel, 2, -1, x.shape[1])
    gate, up = (gate_up[:, i].reshape(cfg.intermediate_size, -1) for i in range(2))
    return x + matmul(layer.w_down, jax.nn.silu(gate) * up)


def forward(weights: TargetWeights, kv: KVPages, batch: ForwardBatch, cfg: ModelConfig,
            tap_indices: tuple[int, ...] = ()):
    """Run the decoder over a ragged batch.  Reads `kv`, never writes it (see model/attention.py).

    Returns (hidden [B, T, D] after the final norm, taps [B, T, len(tap_indices) * D] or None, the new K/V
    rows, in the pools' dtype, to write at batch.slots with `write_rows`).
    """
    b, t = batch.tokens.shape
    x = weights.embed[batch.tokens.reshape(-1)].T  # [D, B*T]
    cos, sin = rope_cos_sin(batch.positions, jnp.asarray(cfg.rope.inv_freq(cfg.head_dim)))
    taps = {0: x} if 0 in tap_indices else {}
    new_k, new_v = [], []
    for i, layer in enumerate(weights.layers):
        x, k_new, v_new = attention_block(layer, cfg, x, *kv.layer(i), batch, cos, sin, weights.attention_kernel,
                                          weights.attention_any_queries)
        x = mlp_block(layer, cfg, x)
        new_k.append(k_new)
        new_v.append(v_new)
        if i + 1 in tap_indices:
            taps[i + 1] = x
    hidden = kept(rms_norm(x, weights.final_norm[:, None], cfg.rms_norm_eps, axis=0)).T.reshape(b, t, -1)
    tapped = kept(jnp.concatenate([taps[i] for i in tap_indices], axis=0)).T.reshape(b, t, -1) if tap_indices else None
    if kv.stacked:  # as the pools: two outputs, two operands of the commit
        return hidden, tapped, KVRows(k=jnp.stack(new_k), v=jnp.stack(new_v))
    return hidden, tapped, KVRows(k=tuple(new_k), v=tuple(new_v))


def logits(weights: TargetWeights, hidden: jax.Array) -> jax.Array:
    """LM head: hidden [..., D] -> float32 logits [..., V] (computed vocab-major, [V, rows], then transposed)."""
    return _token_major(_vocab_major(weights, hidden), hidden)


def _vocab_major(weights: TargetWeights, hidden: jax.Array) -> jax.Array:
    return head_product(weights.head_matrix, hidden.reshape(-1, hidden.shape[-1]))


def _token_major(out: jax.Array, hidden: jax.Array) -> jax.Array:
    return kept(out).T.reshape(*hidden.shape[:-1], -1)


def logits_and_greedy(weights: TargetWeights, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits [..., V], their argmax [...] int32), the argmax taken from the vocab-major product [V, rows] itself,
    on `argmax_kernel` where the loader set one: a greedy step never reads the transposed logits, so its program
    does not make them (XLA:CPU's transposed copy and three reductions over it: ~0.5 ms of a 4-row SmolLM2 step,
    ~0.2 ms of a 1-row one; its reductions over [V, rows] as they lie are no faster, 0.7 ms for 4 rows)."""
    out = _vocab_major(weights, hidden)
    return _token_major(out, hidden), vocab_major_argmax(out, weights.argmax_kernel).reshape(hidden.shape[:-1])



def cast_weights(weights, dtype):
    """Cast every floating leaf of a weights pytree to `dtype`."""
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, weights)


def replace(obj, **changes):
    return dataclasses.replace(obj, **changes)
