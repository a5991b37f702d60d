"""The glibc allocator setting for XLA:CPU temporaries (specjax/hostmem.py).  The applying case runs in a fresh
process: the setting is process-wide and the suite keeps glibc's defaults (tests/conftest.py)."""

import os
import subprocess
import sys

import pytest

from specjax.hostmem import keep_freed_memory

PROBE = "from specjax.hostmem import keep_freed_memory; print(keep_freed_memory(), keep_freed_memory())"


def test_opt_out_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setenv("SPECJAX_MALLOC_TUNING", "0")
    assert keep_freed_memory() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_applies_on_glibc_and_is_idempotent():
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        glibc = False
    if not glibc:
        pytest.skip("not glibc")
    env = {k: v for k, v in os.environ.items() if k != "SPECJAX_MALLOC_TUNING"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["True", "True"]


RELEASE_PROBE = """
import numpy as np
from specjax.hostmem import keep_freed_memory, release_freed_memory, resident_bytes
assert keep_freed_memory()
base = resident_bytes()
chunks = [np.ones(2 ** 21, np.float32) for _ in range(48)]  # 48 x 8 MiB from the heap (mmap is off)
del chunks
kept = resident_bytes()
print(kept - base, release_freed_memory(), resident_bytes() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_memory_stays_resident_until_released():
    """The tuning keeps a freed peak resident (the price it documents); release_freed_memory gives it back."""
    env = {k: v for k, v in os.environ.items() if k != "SPECJAX_MALLOC_TUNING"}
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    kept, released, after = int(out[0]), out[1], int(out[2])
    assert kept > 300 * 2 ** 20, kept  # ~384 MiB touched and freed, still resident
    assert released == "True"
    assert after < 64 * 2 ** 20, after


ZERO_PAGES_PROBE = """
import jax, jax.numpy as jnp
from specjax.hostmem import keep_freed_memory, release_zero_pages, resident_bytes
assert keep_freed_memory()
pools = [jnp.zeros((3, 2048, 16, 64), jnp.float32) for _ in range(8)]  # 8 x 24 MiB, filled by XLA
write = jax.jit(lambda p: p.at[1, :4].set(1.0), donate_argnums=0).lower(pools[0]).compile()  # writes 4 pages
jax.block_until_ready(pools)
before = resident_bytes()
released = release_zero_pages(pools)
after = resident_bytes()
pools[0] = jax.block_until_ready(write(pools[0]))  # in place
regrown = resident_bytes() - after
print(released, before - after, regrown, float(sum(jnp.abs(p).sum() for p in pools)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")
def test_zeroed_pools_give_their_pages_back_and_still_read_zeros():
    """release_zero_pages drops the pages XLA's zero fill made resident; the arrays still read as zeros, and an
    in-place write makes only the pages it touches resident again."""
    env = {k: v for k, v in os.environ.items() if k != "SPECJAX_MALLOC_TUNING"}
    out = subprocess.run([sys.executable, "-c", ZERO_PAGES_PROBE], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    released, dropped, regrown, total = int(out[0]), int(out[1]), int(out[2]), float(out[3])
    pools = 8 * 3 * 2048 * 16 * 64 * 4
    assert released > 0.99 * pools, (released, pools)
    assert dropped > 0.9 * pools, (dropped, pools)
    assert regrown < pools // 32, regrown  # 4 pages x 16 x 64 floats written: far less than one pool (24 MiB)
    assert total == 4 * 16 * 64
