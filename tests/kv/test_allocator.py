"""Page allocator invariants under random operation sequences (hypothesis), and bucket choice."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.engine.buckets import pick_bucket, pow2_buckets
from specjax.kv.allocator import OutOfPages, PageAllocator

ops = st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(0, 70)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 24), st.integers(1, 8), ops)
def test_allocator_invariants(num_pages, page_size, operations):
    alloc = PageAllocator(num_pages, page_size)
    for op, owner, n in operations:
        before = {o: list(p) for o, p in alloc.owned.items()}
        if op == "grow":
            try:
                pages = alloc.grow(owner, n)
                assert len(pages) >= alloc.pages_for(n)
                assert pages[:len(before.get(owner, []))] == before.get(owner, [])  # existing pages keep their order
            except OutOfPages:
                assert {o: list(p) for o, p in alloc.owned.items()} == before  # all-or-nothing
        else:
            freed = alloc.free(owner)
            assert freed == len(before.get(owner, []))
        alloc.check()
    for owner in list(alloc.owned):
        alloc.free(owner)
    assert alloc.num_free == num_pages - 1


def test_allocator_rejects_bad_geometry():
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PageAllocator(1, 4)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        PageAllocator(4, 0)


@given(st.integers(1, 512))
def test_pick_bucket_is_minimal(n):
    buckets = pow2_buckets(16, 512)
    b = pick_bucket(n, buckets)
    assert b >= n and all(x < n for x in buckets if x < b)


def test_pow2_buckets_end_at_largest():
    assert pow2_buckets(16, 100) == (16, 32, 64, 100)
    assert pow2_buckets(1, 1) == (1,)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        pick_bucket(101, (16, 100))
