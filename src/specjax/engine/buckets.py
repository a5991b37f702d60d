"""The one place where step shapes are chosen: batch, prefill-token and KV-page buckets, and padding."""

from __future__ import annotations

import bisect


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n (buckets sorted ascending); ValueError if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def pow2_buckets(smallest: int, largest: int, factor: int = 2) -> tuple[int, ...]:
    """(smallest, factor*smallest, ..., largest), always ending exactly at `largest`."""
    out, b = [], max(1, smallest)
    while b < largest:
        out.append(b)
        b *= factor
    out.append(largest)
    return tuple(out)
