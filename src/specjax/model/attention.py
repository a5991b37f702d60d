"""Paged KV storage and attention over it, plus the dense reference used as its oracle in tests.

Layout: one pool per layer for K and one for V, each [P, Z, K, H] (P pages of Z slots).  A sequence's logical
position p lives in page `page_table[p // Z]` at offset `p % Z`; the host precomputes `slots = page * Z + offset`
for every token it writes (-1 = do not write).  Page 0 is a scratch page the allocator never hands out, so
padding entries of a page table may point at it safely: everything read from it is masked.

Reads and writes are split on purpose.  A forward only READS the pools: it gathers each sequence's pages and
patches this step's new K/V into the gathered copy.  The new rows are written into the pools afterwards by a
separate, donated call (`write_rows`).  Measured on XLA:CPU, a computation that both gathers from a donated
pool and scatters into it copies the whole pool on every step (SmolLM2 decode went from 28 to 150 ms/token as
the pool grew from 17 to 257 pages); split, the write is in place and the step cost is independent of the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dataclasses import dataclass

from specjax.model.layers import grouped_attention


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVRows:
    """New K/V rows of one step, one [B, T, K, H] array per layer, waiting to be written at their slots."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


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


def insert_rows(cache: jax.Array, positions: jax.Array, valid: jax.Array, rows: jax.Array) -> jax.Array:
    """Patch rows [B, T, K, H] into a gathered cache [B, S, K, H] at logical `positions` [B, T] where `valid`."""
    b, s = cache.shape[:2]
    pos = jnp.where(valid & (positions >= 0) & (positions < s), positions, s)  # invalid -> out of bounds -> dropped
    return cache.at[jnp.arange(b)[:, None], pos].set(rows.astype(cache.dtype), mode="drop")


def causal_visibility(positions: jax.Array, num_keys: int) -> jax.Array:
    """Key j is visible to a query at absolute position p iff j <= p.  positions [B, T] -> [B, T, S] bool.

    Keys are logical positions (page tables are in order), so causality alone also hides stale entries past the
    current length: every position <= p was written by this or an earlier forward.
    """
    return jnp.arange(num_keys)[None, None, :] <= positions[:, :, None]


def paged_attention(q, k_pool, v_pool, page_table, positions, valid, k_new, v_new, scale):
    """Causal attention of q [B, T, N, H] at `positions` [B, T] over the paged cache plus this step's own
    K/V rows k_new, v_new [B, T, K, H] (inserted where `valid`).  Returns [B, T, N, H]."""
    k = insert_rows(gather_pages(k_pool, page_table), positions, valid, k_new)
    v = insert_rows(gather_pages(v_pool, page_table), positions, valid, v_new)
    return grouped_attention(q, k, v, causal_visibility(positions, k.shape[1]), scale)


def write_rows(pools, slots: jax.Array, rows: KVRows | None):
    """Write a step's rows into every layer's pools (a KVPages-like pytree with .k/.v tuples) at `slots`."""
    if rows is None:
        return pools
    return type(pools)(k=tuple(write_pages(p, slots, r) for p, r in zip(pools.k, rows.k)),
                       v=tuple(write_pages(p, slots, r) for p, r in zip(pools.v, rows.v)))


def dense_attention(q, k, v, positions, scale):
    """Oracle: causal attention over contiguous per-sequence K/V [B, S, K, H] (key j at position j)."""
    return grouped_attention(q, k, v, causal_visibility(positions, k.shape[1]), scale)
