"""Host memory: the allocator setting for XLA:CPU (reuse freed memory instead of unmapping it after every step)
and the process's resident size.

XLA:CPU takes each execution's temporaries (for a batched decode step, tens to hundreds of MB of gathered KV
pages) from malloc.  glibc serves blocks above its mmap threshold with a fresh mmap and unmaps them on free, so
every step page-faults its whole working set again: 48k minor faults, about half of a batch-8 SmolLM2 decode
step (docs/results/kflat.md).  With mmap off and a high trim threshold the same blocks are reused.  Each thread
keeps glibc's own arena: with one arena for all (as before commit 69fc441, 2026-12-06), the Python thread
dispatching a step, XLA's executor threads and the kernels' helpers took one lock for every allocation, and a
batch-1 decode step of the engine ran 1.12-1.19x slower (scripts/malloc_arena_ab.py at 8707224: every paired
round, two runs of six).  The price: memory freed after a peak stays mapped in the process (reused, not returned to
the OS), so after a one-off peak (loading weights, compiling) `release_freed_memory` hands the free pages back
explicitly.
Linux/glibc only; SPECJAX_MALLOC_TUNING=0 leaves the allocator alone.

`release_zero_pages` hands back the physical pages under freshly zeroed device arrays on the CPU (the KV pools):
they read as zeros again and only the pages a step later writes become resident.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (glibc malloc.h)
MADV_DONTNEED = 4  # linux/mman.h: private anonymous pages read back as zeros


def keep_freed_memory() -> bool:
    """Configure glibc malloc for XLA:CPU's per-step temporaries; True when applied.  Idempotent."""
    if os.environ.get("SPECJAX_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)
                    and libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False


def release_freed_memory(collect: bool = True) -> bool:
    """Return the free pages of malloc's heap to the OS (glibc `malloc_trim`): after a one-off peak such as a
    checkpoint's float32 copies during loading, which the tuning above would otherwise keep resident for good.
    True when glibc released anything.  `collect`: collect reference cycles first (their arrays are freed only
    then; ~0.1 s holding the GIL, so not on a thread beside the engine's)."""
    if collect:
        gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


def private_anonymous_ranges() -> list[tuple[int, int]]:
    """[start, end) of this process's private anonymous mappings (heap included), from /proc/self/maps, adjacent
    ones merged."""
    ranges: list[tuple[int, int]] = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            path = fields[5] if len(fields) > 5 else ""
            if fields[1][3] == "p" and path in ("", "[heap]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if ranges and ranges[-1][1] == start:
                    start = ranges.pop()[0]
                ranges.append((start, end))
    return ranges


def release_zero_pages(tree) -> int:
    """Give the OS back the physical pages under the arrays of `tree`, all of which must hold only zeros (a
    KV pool just made by jnp.zeros): `madvise(MADV_DONTNEED)` on the whole pages inside each CPU buffer that lies
    in a private anonymous mapping, which then reads as zeros again, so the values are unchanged and a page
    becomes resident only when something writes it.  XLA:CPU fills a new zeros array, so a 1 GiB pool would
    otherwise be resident from start-up whether or not a request ever uses it.  Returns the bytes released
    (0 off Linux, on other devices, or where a buffer is not private anonymous memory)."""
    import jax

    if not sys.platform.startswith("linux"):
        return 0
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    jax.block_until_ready(leaves)  # the fill must be done before its pages go
    try:
        libc = ctypes.CDLL("libc.so.6")
        ranges = private_anonymous_ranges()
    except OSError:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    released = 0
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            ptr, size = shard.data.unsafe_buffer_pointer(), shard.data.nbytes
            start, end = -(-ptr // page) * page, (ptr + size) // page * page
            if end <= start or not any(lo <= start and end <= hi for lo, hi in ranges):
                continue
            if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
                released += end - start
    return released


def resident_bytes() -> int:
    """This process's resident set size now (Linux /proc), else its peak (getrusage), in bytes."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
