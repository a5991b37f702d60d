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
