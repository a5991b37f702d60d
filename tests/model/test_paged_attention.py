"""Paged attention equals dense attention on random ragged layouts (shuffled pages, padding, -1 slots), on XLA's
gathered path and on the in-place CPU kernel (kernels/paged_attention.cc), over float32 and 16-bit pools; the K/V
write kernel (kernels/kv_write.cc) equals XLA's scatter; a step hands the commit its rows in the pools' dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine import runner
from specjax.model.attention import (
    KVRows,
    PoolView,
    dense_attention,
    gather_pages,
    paged_attention,
    pages_and_new_attention,
    write_pages,
    write_rows,
)
from specjax.model.target import KVPages
from tests.helpers import native_attention_kernel, native_kernels


@pytest.mark.parametrize("native", [False, True], ids=["xla", "kernel"])
@pytest.mark.parametrize(("seed", "pool_dtype"), [(seed, "float32") for seed in range(5)]
                         + [(0, "float16"), (3, "float16"), (2, "bfloat16"), (4, "bfloat16")])
def test_paged_equals_dense_on_random_ragged_layouts(seed, pool_dtype, native):
    """A 16-bit pool holds every key rounded to its dtype, this step's own rows included: the dense oracle attends
    over the rounded keys in float32."""
    kernel = native_attention_kernel() if native else None
    rng = np.random.default_rng(seed)
    b, n_heads, kv_heads, hd = 3, 6, 2, 32
    page_size = int(rng.integers(1, 6))
    lens = rng.integers(1, 40, size=b)  # tokens already in each sequence's cache after this step
    if seed >= 3:
        lens[0] += 520  # long enough for the kernel to split the cached rows into chunks (of 256): three here
    new = np.minimum(rng.integers(1, 6, size=b), lens)  # the last `new` of them are this step's queries
    pages_per_seq = [-(-int(n) // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 4
    pool_ids = rng.permutation(np.arange(1, num_pages))
    tables, at = [], 0
    for n in pages_per_seq:
        tables.append(pool_ids[at:at + n])
        at += n
    pg = max(pages_per_seq) + int(rng.integers(0, 3))  # extra padding columns -> scratch page 0
    table = np.zeros((b, pg), np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t

    s_max = int(lens.max())
    k_dense = rng.normal(size=(b, s_max, kv_heads, hd)).astype(np.float32)
    v_dense = rng.normal(size=(b, s_max, kv_heads, hd)).astype(np.float32)
    # Fill the pool with garbage, then write every sequence's keys at their slots (including this step's).
    k_pool = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, hd)), pool_dtype)
    v_pool = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, hd)), pool_dtype)
    slots = np.full((b, s_max), -1, np.int32)
    for i in range(b):
        p = np.arange(lens[i])
        slots[i, :lens[i]] = tables[i][p // page_size] * page_size + p % page_size
    k_pool = write_pages(k_pool, jnp.asarray(slots), jnp.asarray(k_dense))
    v_pool = write_pages(v_pool, jnp.asarray(slots), jnp.asarray(v_dense))

    t = int(new.max()) + 1  # one padding query column at least
    q = rng.normal(size=(b, t, n_heads, hd)).astype(np.float32)
    positions = np.zeros((b, t), np.int32)  # padding queries sit at position 0 with slot -1
    valid = np.zeros((b, t), bool)
    k_new = np.zeros((b, t, kv_heads, hd), np.float32)
    v_new = np.zeros((b, t, kv_heads, hd), np.float32)
    for i in range(b):
        positions[i, :new[i]] = np.arange(lens[i] - new[i], lens[i])
        valid[i, :new[i]] = True
        k_new[i, :new[i]] = k_dense[i, lens[i] - new[i]:lens[i]]
        v_new[i, :new[i]] = v_dense[i, lens[i] - new[i]:lens[i]]
    # This step's own rows are NOT in the pool yet (the forward reads, a later call writes): blank them there.
    step_slots = np.where(valid, np.take_along_axis(slots, positions, axis=1), -1)
    k_pool = write_pages(k_pool, jnp.asarray(step_slots), jnp.full((b, t, kv_heads, hd), 7.0))
    v_pool = write_pages(v_pool, jnp.asarray(step_slots), jnp.full((b, t, kv_heads, hd), 7.0))
    scale = hd ** -0.5
    paged = np.asarray(paged_attention(jnp.asarray(q), k_pool, v_pool, jnp.asarray(table), jnp.asarray(positions),
                                       jnp.asarray(valid), jnp.asarray(k_new), jnp.asarray(v_new), scale, kernel))
    stored = [jnp.asarray(x).astype(pool_dtype).astype(jnp.float32) for x in (k_dense, v_dense)]
    dense = np.asarray(dense_attention(jnp.asarray(q), *stored, jnp.asarray(positions), scale))
    assert paged.dtype == np.float32
    for i in range(b):
        np.testing.assert_allclose(paged[i, :new[i]], dense[i, :new[i]], atol=1e-5, rtol=1e-5)
    assert np.isfinite(paged).all(), "padding queries must not produce NaN"


def test_write_pages_drops_negative_slots_and_gather_orders_logically():
    pool = jnp.zeros((1, 4, 2, 1))  # [K, P, Z, H]
    pool = write_pages(pool, jnp.asarray([[5, -1, 2]]), jnp.asarray([[[[1.0]], [[9.0]], [[3.0]]]]))
    flat = np.asarray(pool).reshape(-1)
    assert flat[5] == 1.0 and flat[2] == 3.0 and flat.sum() == 4.0  # the -1 write (9.0) was dropped
    got = np.asarray(gather_pages(pool, jnp.asarray([[2, 1]]))).reshape(-1)
    np.testing.assert_array_equal(got, [0.0, 1.0, 3.0, 0.0])  # page 2 (slots 4, 5) then page 1 (slots 2, 3)
    assert jax.numpy.issubdtype(pool.dtype, jnp.floating)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_write_kernel_equals_xla_scatter_in_place(dtype):
    kernel = native_kernels().kv_write
    rng = np.random.default_rng(0)
    layers, kv_heads, pages, page_size, hd, b, t = 3, 2, 5, 4, 16, 2, 3
    base = KVPages(*(tuple(jnp.asarray(rng.standard_normal((kv_heads, pages, page_size, hd)), dtype)
                           for _ in range(layers)) for _ in range(2)))
    rows = KVRows(*(tuple(jnp.asarray(rng.standard_normal((b, t, kv_heads, hd)), jnp.float32) for _ in range(layers))
                    for _ in range(2)))
    # padding (-1), past the pool's end (pages * page_size: dropped, as scatter's mode="drop"), page 0's slot 0
    slots = jnp.asarray([[5, -1, 19], [0, pages * page_size, 7]], jnp.int32)
    want = write_rows(base, slots, rows)
    assert not np.array_equal(np.asarray(want.k[0], np.float32), np.asarray(base.k[0], np.float32))
    got = write_rows(base, slots, rows, kernel)
    # donated to the engine's commit, every pool is written where it lies: no copy of the pool
    kv = jax.tree.map(jnp.copy, base)
    where = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(kv)]
    committed, _ = runner.commit(kv, None, slots, rows, slots, None, kernel=kernel)
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(committed)] == where
    for out in (got, committed):
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(out)):
            assert g.dtype == dtype
            np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(g, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_stacked_pools_are_read_and_written_in_place(dtype):
    """KVPages.stacked (every layer's pool in one [L, K, P, Z, H] array): the K/V write kernel and XLA's scatter
    write each layer as into its own pool, in place when donated; the attention kernel reads a PoolView's layer
    inside the stack bit-identically to that layer's own pool, and so does the gathered path; a layer past the
    stack is refused."""
    kernels = native_kernels()
    rng = np.random.default_rng(3)
    layers, kv_heads, n_heads, pages, page_size, hd, b, t = 3, 2, 4, 6, 4, 16, 2, 3
    apart = KVPages(*(tuple(jnp.asarray(rng.standard_normal((kv_heads, pages, page_size, hd)), dtype)
                            for _ in range(layers)) for _ in range(2)))
    stacked = KVPages(*(jnp.stack(pools) for pools in (apart.k, apart.v)))
    assert stacked.stacked and not apart.stacked
    assert (stacked.num_pages, stacked.page_size) == (apart.num_pages, apart.page_size) == (pages, page_size)
    new = [[jnp.asarray(rng.standard_normal((b, t, kv_heads, hd)), jnp.float32) for _ in range(layers)]
           for _ in range(2)]
    slots = jnp.asarray([[5, -1, 19], [0, pages * page_size, 7]], jnp.int32)
    want = write_rows(apart, slots, KVRows(*(tuple(r) for r in new)), kernels.kv_write)
    rows = KVRows(*(jnp.stack(r) for r in new))
    kv = jax.tree.map(jnp.copy, stacked)
    where = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(kv)]
    committed, _ = runner.commit(kv, None, slots, rows, slots, None, kernel=kernels.kv_write)
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(committed)] == where
    for got in (committed, write_rows(stacked, slots, rows)):
        for w, g in zip((want.k, want.v), (got.k, got.v)):
            np.testing.assert_array_equal(np.asarray(jnp.stack(w), np.float32), np.asarray(g, np.float32))
    q = jnp.asarray(rng.standard_normal((b, t, n_heads, hd)), jnp.float32)
    table = jnp.asarray([[1, 3, 5], [4, 2, 0]], jnp.int32)
    lens, visible = jnp.asarray([9, 5], jnp.int32), jnp.ones((b, t, t), bool)
    for kernel in (kernels.attention, None):
        for i in range(layers):
            args = (table, lens, new[0][i], new[1][i], visible, hd ** -0.5, kernel, True)
            own = pages_and_new_attention(q, *want.layer(i), *args)
            view = pages_and_new_attention(q, *committed.layer(i), *args)
            np.testing.assert_array_equal(np.asarray(own), np.asarray(view))
    past = PoolView(committed.k, layers), PoolView(committed.v, layers)
    with pytest.raises(Exception, match="layer"):
        jax.block_until_ready(pages_and_new_attention(q, *past, table, lens, new[0][0], new[1][0], visible,
                                                      hd ** -0.5, kernels.attention, True))


@pytest.mark.parametrize(("hd", "start", "pool_dtype"), [(64, 40, "float32"), (64, 254, "float32"),
                                                       (128, 40, "float32"), (128, 254, "float32"),
                                                       (64, 254, "float16"), (128, 40, "bfloat16")])
def test_kernel_verification_rows_equal_decoding_rows_bit_for_bit(hd, start, pool_dtype):
    """Row t of a verification over `start` cached rows and 4 new ones equals, bit for bit, plain decoding's row at
    the same position over start + t cached rows and its own, and the verification's rows do not change beside
    another sequence: the kernel's result depends only on the keys a row sees (254: the new rows straddle the chunk
    boundary at 256), 16-bit pools included (the new rows are rounded as the pool stores them)."""
    kernel = native_attention_kernel()
    rng = np.random.default_rng(hd + start)
    n_heads, kv_heads, page_size, t = 6, 2, 16, 4
    pages = -(-(start + t) // page_size)
    table = jnp.asarray(rng.permutation(np.arange(1, pages + 1))[None].astype(np.int32))
    k_all = rng.normal(size=(1, start + t, kv_heads, hd)).astype(np.float32)
    v_all = rng.normal(size=(1, start + t, kv_heads, hd)).astype(np.float32)
    q = jnp.asarray(rng.normal(size=(1, t, n_heads, hd)).astype(np.float32))
    pos = np.arange(start + t)
    slots = jnp.asarray((np.asarray(table)[0][pos // page_size] * page_size + pos % page_size)[None].astype(np.int32))
    k_pool = write_pages(jnp.zeros((kv_heads, pages + 1, page_size, hd), pool_dtype), slots, jnp.asarray(k_all))
    v_pool = write_pages(jnp.zeros((kv_heads, pages + 1, page_size, hd), pool_dtype), slots, jnp.asarray(v_all))
    causal = jnp.asarray(np.tril(np.ones((t, t), bool))[None])
    verify = pages_and_new_attention(q, k_pool, v_pool, table, jnp.asarray([start]), jnp.asarray(k_all[:, start:]),
                                     jnp.asarray(v_all[:, start:]), causal, hd ** -0.5, kernel)
    for j in range(t):
        decode = pages_and_new_attention(q[:, j:j + 1], k_pool, v_pool, table, jnp.asarray([start + j]),
                                         jnp.asarray(k_all[:, start + j:start + j + 1]),
                                         jnp.asarray(v_all[:, start + j:start + j + 1]), jnp.ones((1, 1, 1), bool),
                                         hd ** -0.5, kernel)
        np.testing.assert_array_equal(np.asarray(verify[:, j]), np.asarray(decode[:, 0]))
    # beside another sequence (its own length, table and new rows) in one call: the same rows, bit for bit
    other = int(rng.integers(1, start + 1))
    tables = jnp.concatenate([table, table[:, ::-1]])
    k2 = jnp.asarray(np.concatenate([k_all[:, start:], rng.normal(size=(1, t, kv_heads, hd)).astype(np.float32)]))
    v2 = jnp.asarray(np.concatenate([v_all[:, start:], rng.normal(size=(1, t, kv_heads, hd)).astype(np.float32)]))
    q2 = jnp.concatenate([q, jnp.asarray(rng.normal(size=(1, t, n_heads, hd)).astype(np.float32))])
    both = pages_and_new_attention(q2, k_pool, v_pool, tables, jnp.asarray([start, other]), k2, v2,
                                   jnp.concatenate([causal, causal]), hd ** -0.5, kernel)
    np.testing.assert_array_equal(np.asarray(both[:1]), np.asarray(verify))
    k_all, v_all = (np.asarray(jnp.asarray(x).astype(pool_dtype).astype(jnp.float32)) for x in (k_all, v_all))
    dense = dense_attention(q, jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(pos[start:][None]), hd ** -0.5)
    np.testing.assert_allclose(np.asarray(verify), np.asarray(dense), atol=1e-5, rtol=1e-5)


CONCURRENT_PROGRAMS = """
import sys, threading
import jax, jax.numpy as jnp, numpy as np
from specjax.kernels import quant_kernels
from specjax.model.attention import pages_and_new_attention

kernel = quant_kernels().attention
rng = np.random.default_rng(0)
pools = [jnp.asarray(rng.standard_normal((3, 64, 16, 64), np.float32)) for _ in range(2)]
table, lens = jnp.arange(64, dtype=jnp.int32)[None], jnp.array([900], jnp.int32)
w = jnp.asarray(rng.standard_normal((640, 640), np.float32) / 20)
big = jnp.asarray(rng.standard_normal((256, 640), np.float32))


@jax.jit
def step(x, big, w, kp, vp):  # an Eigen product (finished on a pool thread), then the kernel, four times
    for _ in range(4):
        x = jnp.tanh(x @ w) + jnp.tanh(big @ w)[:1] * 0.01
        q = x[:, :576].reshape(1, 1, 9, 64)
        o = pages_and_new_attention(q, kp, vp, table, lens, q[:, :, :3], q[:, :, 3:6], jnp.ones((1, 1, 1), bool),
                                    0.125, kernel)
        x = x + jnp.pad(o.reshape(1, 576), ((0, 0), (0, 64))) * 0.01
    return x


def run(x, out, i):
    for _ in range(int(sys.argv[1])):
        x = step(x, big, w, *pools).block_until_ready()
    out[i] = np.asarray(x)


x0 = jnp.asarray(rng.standard_normal((1, 640), np.float32))
alone = [None]
run(x0, alone, 0)
out = [None] * 3
threads = [threading.Thread(target=run, args=(x0, out, i)) for i in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert all(np.array_equal(o, alone[0]) for o in out), "a concurrent program's attention differs from a lone one's"
print("ok")
"""


def test_attention_kernel_programs_run_concurrently_without_deadlock():
    """Three threads run programs whose kernel call follows an Eigen product, so it runs on an XLA:CPU pool thread;
    a kernel that waited for the helper task it queued deadlocked here within a few steps (every pool thread
    spinning for a task queued behind another's), which froze a CI run.  Run in a subprocess: a deadlock fails
    the test instead of freezing the suite's worker."""
    import subprocess
    import sys

    native_kernels()
    try:
        done = subprocess.run([sys.executable, "-c", CONCURRENT_PROGRAMS, "100"], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("programs calling the attention kernel at once deadlocked (no result in 120 s)")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("pool_dtype", ["float16", "bfloat16"])
def test_a_step_rounds_its_own_rows_once(tiny_dirs, pool_dtype):
    """Over 16-bit pools the target's forward returns its new K/V rows already in the pools' dtype, the very values
    its own attention saw, for the commit to write as they are.  Rounding the float32 rows a second time in the
    commit program let a verification row see a key other than the one plain decoding later read back from the
    pool: at XLA's -O0 the shipped drafter on SmolLM2's int8 kernels parted from plain decoding at token 21."""
    from specjax.model import target as tgt
    from specjax.model.loader import load_model

    loaded = load_model(tiny_dirs["llama"])
    cfg = loaded.config
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 6)).astype(np.int32)
    batch = tgt.ForwardBatch(jnp.asarray(ids), jnp.arange(6)[None], jnp.arange(4, 10)[None],
                             jnp.asarray([[1, 2]], jnp.int32))
    rows = {dtype: tgt.forward(loaded.weights, tgt.init_kv_pages(cfg.num_layers, 4, 4, cfg.num_kv_heads,
                                                                  cfg.head_dim, dtype), batch, cfg)[2]
            for dtype in (jnp.float32, jnp.dtype(pool_dtype))}
    for field in ("k", "v"):
        narrow = getattr(rows[jnp.dtype(pool_dtype)], field)
        assert all(r.dtype == jnp.dtype(pool_dtype) for r in narrow)
        # layer 0's rows come before any attention: the same values, rounded (a program that rounds them is not
        # bound to round them as another one does, which is the point: within one unit of the 16-bit format)
        eps = float(jnp.finfo(jnp.dtype(pool_dtype)).eps)
        np.testing.assert_allclose(np.asarray(narrow[0], np.float32),
                                   np.asarray(getattr(rows[jnp.float32], field)[0]), rtol=eps, atol=1e-6)
