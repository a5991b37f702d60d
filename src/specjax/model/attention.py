"""Paged KV storage and attention over it, plus the dense reference used as its oracle in tests.

Layout: one pool per layer for K and one for V, each [P, Z, K, H] (P pages of Z slots).  A sequence's logical
position p lives in page `page_table[p // Z]` at offset `p % Z`; the host precomputes `slots = page * Z + offset`
for every token it writes (-1 = do not write).  Page 0 is a scratch page the allocator never hands out, so
padding entries of a page table may point at it safely: everything read from it is masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.model.layers import grouped_attention


def write_pages(pool: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """Scatter `values` [..., K, H] into `pool` [P, Z, K, H] at flat `slots` [...] (negative = dropped)."""
    num_pages, page_size = pool.shape[:2]
    flat = pool.reshape(num_pages * page_size, *pool.shape[2:])
    idx = slots.reshape(-1)
    idx = jnp.where(idx < 0, num_pages * page_size, idx)  # out of bounds -> dropped
    flat = flat.at[idx].set(values.reshape(-1, *pool.shape[2:]).astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


def gather_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """Read the pages of each sequence in logical order: pool [P, Z, K, H], table [B, Pg] -> [B, Pg*Z, K, H]."""
    pages = pool[page_table]  # [B, Pg, Z, K, H]
    b, pg, z = pages.shape[:3]
    return pages.reshape(b, pg * z, *pool.shape[2:])


def causal_visibility(positions: jax.Array, num_keys: int) -> jax.Array:
    """Key j is visible to a query at absolute position p iff j <= p.  positions [B, T] -> [B, T, S] bool.

    Keys are logical positions (page tables are in order), so causality alone also hides stale entries past the
    current length: every position <= p was written by this or an earlier forward.
    """
    return jnp.arange(num_keys)[None, None, :] <= positions[:, :, None]


def paged_attention(q, k_pool, v_pool, page_table, positions, scale):
    """Causal attention of q [B, T, N, H] at `positions` [B, T] over paged K/V.  Returns [B, T, N, H]."""
    k = gather_pages(k_pool, page_table)
    v = gather_pages(v_pool, page_table)
    return grouped_attention(q, k, v, causal_visibility(positions, k.shape[1]), scale)


def dense_attention(q, k, v, positions, scale):
    """Oracle: causal attention over contiguous per-sequence K/V [B, S, K, H] (key j at position j)."""
    return grouped_attention(q, k, v, causal_visibility(positions, k.shape[1]), scale)
