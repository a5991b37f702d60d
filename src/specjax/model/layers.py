"""Stateless math shared by the target and the drafters: RMSNorm, RoPE, SwiGLU, grouped attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model.quant import linear

# Finite "minus infinity": a fully masked row (padding query) softmaxes to uniform garbage instead of NaN.
MASK_VALUE = -1e30


def fixed_order_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis` (kept, length 1) in one order whatever the other dimensions are: pairwise halves
    (elementwise adds) while the length is even, then the rest in sequence.  XLA:CPU picks a reduction's
    vectorization per shape (a feature-major column's sum over 64 or 576 features changed in the last bit with the
    number of columns), so with jnp.sum a token's row would depend on how many tokens share its step; behind int8
    activations one such bit can move a rounding (docs/results/kflat.md; commit 96d273e, 2026-12-05).  The odd rest
    is short for real widths (576 = 9 x 64, 896 = 7 x 128, 4096 = 1 x 4096)."""
    x = jnp.moveaxis(x, axis, 0)
    while x.shape[0] > 1 and x.shape[0] % 2 == 0:
        x = x[:x.shape[0] // 2] + x[x.shape[0] // 2:]
    total = x[0]
    for i in range(1, x.shape[0]):
        total = total + x[i]
    return jnp.expand_dims(total, axis)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
    """RMSNorm over `axis` (`weight` broadcast against x), computed in float32 (HF semantics: normalise, cast,
    then scale), its sum of squares in a fixed order (`fixed_order_sum`: a row's result does not depend on the
    shape of the batch around it)."""
    xf = x.astype(jnp.float32)
    mean = fixed_order_sum(xf * xf, axis) / np.float32(xf.shape[axis])
    xf = xf * jax.lax.rsqrt(mean + eps)
    return weight * xf.astype(x.dtype)


def kept(x: jax.Array) -> jax.Array:
    """Materialise a product before it is transposed.  Without the barrier XLA folds the transpose into the dot
    and emits the token-major product that model/target.py's feature-major layout exists to avoid (2-16x
    slower on XLA:CPU)."""
    return jax.lax.optimization_barrier(x)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for integer `positions` [...] -> [..., head_dim] (rotate-half layout: halves repeated),
    computed once: without the barrier XLA fuses them into every layer's rotation and evaluates cos and sin per
    element of each layer's q and k (heads times over, 30 layers over: ~0.4 ms of a 4-token SmolLM2 step)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., H]
    both = kept(jnp.stack([jnp.cos(angles), jnp.sin(angles)]))  # one array: a barrier on a pair does not hold
    return both[0], both[1]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [..., T, heads, H] by cos/sin [..., T, H] (NeoX / HF rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return (x * cos + rotated * sin).astype(x.dtype)


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)) with the gate and up projections fused into one [D, 2F] matmul (either weight
    may be a QuantMatrix of the transposed matrix: quant.linear)."""
    gate_up = linear(x, w_gate_up)  # [..., 2F]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w_down)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """Softmax attention with GQA grouping.

    q: [B, T, N, H]; k, v: [B, S, K, H]; visible: [B, T, S] bool.  Returns [B, T, N, H].
    Query head n uses KV head n // (N / K), as in HF `repeat_kv`.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)  # [B, T, K, G, H]
    return out.reshape(b, t, n, h)
