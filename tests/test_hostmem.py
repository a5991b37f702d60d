"""The glibc allocator setting for XLA:CPU temporaries (specjax/hostmem.py)."""

import ctypes
import sys

import pytest

from specjax.hostmem import keep_freed_memory


def test_opt_out_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setenv("SPECJAX_MALLOC_TUNING", "0")
    assert keep_freed_memory() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_applies_on_glibc(monkeypatch):
    monkeypatch.delenv("SPECJAX_MALLOC_TUNING", raising=False)
    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent
