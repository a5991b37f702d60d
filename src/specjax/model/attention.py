"""Paged KV storage and attention over it, plus the dense reference used as its oracle in tests.

Layout: one pool per layer for K and one for V, each [K, P, Z, H] (KV heads outermost, then P pages of Z slots;
where the kernels do all the reading and writing, every layer's in one [L, K, P, Z, H] array, read as PoolView):
gathering a batch's pages yields [K, B, S, H] with the batch dimensions leading, which XLA:CPU multiplies without
a transpose copy (measured 35-40% faster attention than a [P, Z, K, H] layout).  A sequence's logical position p
lives in page `page_table[p // Z]` at offset `p % Z`; the host precomputes `slots = page * Z + offset` for every
token it writes (-1 = do not write).  Page 0 is a scratch page the allocator never hands out, so padding entries
of a page table may point at it safely: everything read from it is masked.

Reads and writes are split on purpose.  A forward only READS the pools; this step's own K/V rows are attended
directly (a second block of scores merged into the same softmax) and written into the pools afterwards by a
separate, donated call (`write_rows`).  Measured on XLA:CPU, a computation that both gathers from a donated pool
and scatters into it copies the whole pool on every step (SmolLM2 decode went from 28 to 150 ms/token as the
pool grew from 17 to 257 pages); split, the write is in place and the step cost is independent of the pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model.layers import MASK_VALUE, grouped_attention


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVRows:
    """New K/V rows of one step, one [B, T, K, H] array per layer (or [L, B, T, K, H] for stacked pools), waiting
    to be written at their slots."""

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array


@dataclass(frozen=True)
class PoolView:
    """Layer `layer` of a pool that holds every layer's [L, K, P, Z, H] (KVPages.stacked): the attention kernel
    reads it in place inside the stack; anything else reads the layer's slice (`pool_array`)."""

    stack: jax.Array
    layer: int

    @property
    def dtype(self):
        return self.stack.dtype


def pool_array(pool) -> jax.Array:
    """A pool [K, P, Z, H] as an array (a PoolView's layer sliced out of its stack)."""
    return pool.stack[pool.layer] if isinstance(pool, PoolView) else pool


def write_pages(pool: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """Scatter `values` [..., K, H] into `pool` [K, P, Z, H] at flat `slots` [...] (negative = dropped); a stacked
    pool [L, K, P, Z, H] takes every layer's values [L, ..., K, H] at the same slots."""
    *lead, kv_heads, num_pages, page_size, head_dim = pool.shape
    flat = pool.reshape(*lead, kv_heads, num_pages * page_size, head_dim)
    idx = slots.reshape(-1)
    idx = jnp.where(idx < 0, num_pages * page_size, idx)  # out of bounds -> dropped
    vals = jnp.swapaxes(values.reshape(*lead, -1, kv_heads, head_dim), -3, -2).astype(pool.dtype)  # [.., K, N, H]
    return flat.at[..., idx, :].set(vals, mode="drop").reshape(pool.shape)


def write_rows(pools, slots: jax.Array, rows, kernel: str | None = None):
    """Write a step's rows into paged state at `slots`.  `pools` is a dataclass whose fields are tuples of
    [K, P, Z, H] pools or stacks [L, K, P, Z, H] (KVPages: k, v); `rows` has the same fields holding [B, T, K, H]
    rows or stacks [L, B, T, K, H] (KVRows).  `kernel`:
    the registered FFI target of kernels/kv_write.cc (TargetWeights.kv_write_kernel), which writes every pool in
    one call, in place when the pools are donated; otherwise one XLA scatter per pool (`write_pages`)."""
    if rows is None:
        return pools
    if kernel is None:
        def write(p, r):  # a field holds a pool per layer, or one stacked pool
            if isinstance(p, tuple):
                return tuple(write_pages(pi, slots, ri) for pi, ri in zip(p, r, strict=True))
            return write_pages(p, slots, r)

        return type(pools)(**{f.name: write(getattr(pools, f.name), getattr(rows, f.name))
                              for f in dataclasses.fields(pools)})
    flat, tree = jax.tree.flatten(pools)
    flat_rows = [r.reshape(*p.shape[:-4], -1, *r.shape[-2:]).astype(p.dtype)  # [(L,) N, K, H]
                 for p, r in zip(flat, jax.tree.leaves(rows), strict=True)]
    out = jax.ffi.ffi_call(kernel, [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat],
                           input_output_aliases={1 + i: i for i in range(len(flat))})(
        slots.reshape(-1).astype(jnp.int32), *flat, *flat_rows)
    return jax.tree.unflatten(tree, out)


def gather_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """Read the pages of each sequence in logical order: pool [K, P, Z, H], table [B, Pg] -> [K, B, Pg*Z, H]."""
    pages = pool[:, page_table]  # [K, B, Pg, Z, H]
    k, b, pg, z, h = pages.shape
    return pages.reshape(k, b, pg * z, h)


def cached_and_new_attention(q, k_cache, v_cache, cache_visible, k_new, v_new, new_visible, scale):
    """Softmax attention over two key sets at once: gathered cache rows and this step's own rows.

    q [B, T, N, H]; k_cache, v_cache [K, B, S, H]; cache_visible [B, S] (the same for every query) or
    [B, T, S] (per query, e.g. DFlash training where each block sees only the context before its anchor);
    k_new, v_new [B, T2, K, H]; new_visible [B, T, T2].  Returns [B, T, N, H].  Query head n uses KV head
    n // (N / K) (HF repeat_kv).  Fully masked rows (padding) come out finite.
    """
    b, t, n, h = q.shape
    kv_heads = k_cache.shape[0]
    g = n // kv_heads
    qq = q.reshape(b, t, kv_heads, g, h).transpose(2, 0, 1, 3, 4).reshape(kv_heads, b, t * g, h)  # rows (t, g)
    kn = k_new.transpose(2, 0, 1, 3)  # [K, B, T2, H]
    vn = v_new.transpose(2, 0, 1, 3)
    s_cache = jnp.einsum("kbqh,kbsh->kbqs", qq, k_cache, preferred_element_type=jnp.float32) * scale
    if cache_visible.ndim == 2:
        s_cache = jnp.where(cache_visible[None, :, None, :], s_cache, MASK_VALUE)
    else:
        s_cache = jnp.where(jnp.repeat(cache_visible, g, axis=1)[None], s_cache, MASK_VALUE)
    s_new = jnp.einsum("kbqh,kbth->kbqt", qq, kn, preferred_element_type=jnp.float32) * scale
    s_new = jnp.where(jnp.repeat(new_visible, g, axis=1)[None], s_new, MASK_VALUE)
    m = jnp.maximum(s_cache.max(-1, keepdims=True), s_new.max(-1, keepdims=True))
    p_cache, p_new = jnp.exp(s_cache - m), jnp.exp(s_new - m)
    denom = p_cache.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)
    out = (jnp.einsum("kbqs,kbsh->kbqh", p_cache.astype(v_cache.dtype), v_cache)
           + jnp.einsum("kbqt,kbth->kbqh", p_new.astype(vn.dtype), vn)) / denom.astype(vn.dtype)
    return out.reshape(kv_heads, b, t, g, h).transpose(1, 2, 0, 3, 4).reshape(b, t, n, h)


# Most query tokens per sequence (T) that go to the in-place paged-attention kernel (decode, verification and
# drafter steps); wider calls (prefill chunks) are matrix-shaped enough for XLA's gathered attention to be faster.
KERNEL_MAX_QUERIES = 8


# The pool dtypes kernels/paged_attention.cc reads (a 16-bit pool is widened to float32 as it is read).
KERNEL_POOL_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def reads_pages_in_place(kernel: str | None, queries: int, dtype, head_dim: int, any_queries: bool = False) -> bool:
    """Does attention of `queries` rows per sequence over `dtype` pools of `head_dim` go to the in-place kernel
    (up to KERNEL_MAX_QUERIES of them, or any number with `any_queries`: TargetWeights.attention_any_queries)?
    Its cost then does not depend on the page table's width (it reads each sequence's cached rows only), so a step
    may pass the widest table at no cost; the gathered path copies every page of the table."""
    return (kernel is not None and (queries <= KERNEL_MAX_QUERIES or any_queries)
            and jnp.dtype(dtype) in KERNEL_POOL_DTYPES and kernel_fits(head_dim))


def kernel_fits(head_dim: int) -> bool:
    """Can kernels/paged_attention.cc attend over heads of this size?"""
    return head_dim % 16 == 0 and head_dim <= 256


def paged_attention(q, k_pool, v_pool, page_table, positions, valid, k_new, v_new, scale, kernel=None,
                    any_queries=False):
    """Causal attention of this step's queries q [B, T, N, H] at `positions` [B, T] (consecutive, starting at
    positions[:, 0] = the number of cached tokens) over the cached pages plus the step's own rows k_new, v_new
    [B, T, K, H] (`valid` [B, T] marks real tokens).  Returns [B, T, N, H]."""
    t = q.shape[1]
    new_visible = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None] & valid[:, None, :]  # causal in step
    return pages_and_new_attention(q, k_pool, v_pool, page_table, positions[:, 0], k_new, v_new, new_visible, scale,
                                   kernel, any_queries)


def pages_and_new_attention(q, k_pool, v_pool, page_table, cache_lens, k_new, v_new, new_visible, scale,
                            kernel=None, any_queries=False):
    """`cached_and_new_attention` with the cache read from pages: every query of sequence b sees its cached rows
    s < cache_lens[b] [B] and the new rows new_visible [B, T, T2] allows.  `kernel`: the registered FFI target of
    kernels/paged_attention.cc (TargetWeights.attention_kernel), which reads the pages in place and does the whole
    softmax (a row's result then depends only on the keys it sees: verification rows are bit-identical to plain
    decoding's), for float32 queries, at most KERNEL_MAX_QUERIES per sequence (any number with `any_queries`);
    otherwise the pages are gathered and XLA attends over the copy.  Either way the step's own rows are rounded to
    the pools' dtype first, so a query sees every key as the pools store it (a float16 cache: as a later step
    will read it back); a caller that also writes them rounds them itself, once (target.attention_block)."""
    b, t, n, h = q.shape
    k_new, v_new = k_new.astype(k_pool.dtype), v_new.astype(v_pool.dtype)
    if not (reads_pages_in_place(kernel, t, k_pool.dtype, h, any_queries) and q.dtype == jnp.float32):
        # a 16-bit cache under wider queries: widen what was gathered (a no-op when the dtypes agree)
        k_cache = gather_pages(pool_array(k_pool), page_table).astype(q.dtype)
        v_cache = gather_pages(pool_array(v_pool), page_table).astype(q.dtype)
        cache_visible = jnp.arange(k_cache.shape[2])[None, :] < cache_lens[:, None]
        return cached_and_new_attention(q, k_cache, v_cache, cache_visible, k_new.astype(q.dtype),
                                        v_new.astype(q.dtype), new_visible, scale)
    # one softmax over the cached rows (read in place) and the step's own rows, all in the kernel
    stacked = isinstance(k_pool, PoolView)
    if stacked != isinstance(v_pool, PoolView) or stacked and k_pool.layer != v_pool.layer:
        raise ValueError("the K and V pools of an attention must be the same layer of the same kind of pools")
    return jax.ffi.ffi_call(kernel, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k_pool.stack if stacked else k_pool, v_pool.stack if stacked else v_pool, page_table.astype(jnp.int32),
        cache_lens.astype(jnp.int32), k_new, v_new,
        jnp.broadcast_to(new_visible, (b, t, k_new.shape[1])).astype(jnp.int32), scale=np.float32(scale),
        layer=np.int64(k_pool.layer if stacked else -1))


def dense_attention(q, k, v, positions, scale):
    """Oracle: causal attention over contiguous per-sequence K/V [B, S, K, H] (key j at position j)."""
    visible = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]
    return grouped_attention(q, k, v, visible, scale)
