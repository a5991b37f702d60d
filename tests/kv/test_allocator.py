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


cache_ops = st.lists(st.tuples(st.sampled_from(["grow", "free", "register", "share"]), st.integers(0, 5),
                               st.integers(0, 40)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 16), st.integers(1, 4), cache_ops)
def test_prefix_cache_invariants(num_pages, page_size, operations):
    """Registering, sharing, freeing and evicting pages in any order keeps every page in exactly one state, the
    reference counts equal to the owners, and a lookup returns only pages holding the prefix they were registered
    under."""
    alloc = PageAllocator(num_pages, page_size)
    content = {}  # page -> the hash it was registered under (what its rows hold)
    for op, owner, n in operations:
        pages = alloc.pages_of(owner)
        if op == "grow":
            try:
                alloc.grow(owner, n)
            except OutOfPages:
                pass
        elif op == "free":
            alloc.free(owner)
        elif op == "register" and pages:
            h = bytes([n % 5])  # few distinct prefixes: collisions with registered ones happen
            alloc.register(owner, n % len(pages), h)
            if alloc.hash_of_page.get(pages[n % len(pages)]) == h:
                content[pages[n % len(pages)]] = h
        elif op == "share" and not pages:
            hashes = [bytes([i]) for i in range(n % 5)]
            hit = alloc.lookup(hashes)
            assert all(content[p] == h for p, h in zip(hit, hashes))
            alloc.share(owner, hit)
        for p in list(content):
            if p not in alloc.hash_of_page:  # evicted and handed out again: its rows are someone else's now
                del content[p]
        alloc.check()
    for owner in list(alloc.owned):
        alloc.free(owner)
    assert alloc.num_used == 0 and alloc.num_free == num_pages - 1


def test_shared_pages_are_never_handed_out_while_owned():
    alloc = PageAllocator(6, 2)
    alloc.grow(0, 4)
    alloc.register(0, 0, b"a")
    alloc.register(0, 1, b"b")
    alloc.free(0)  # both cached, 5 free counted
    assert alloc.num_cached == 2 and alloc.num_free == 5
    hit = alloc.lookup([b"a", b"b", b"c"])
    assert hit == [1, 2]
    alloc.share(1, hit[:1])
    alloc.grow(2, 8)  # 4 pages: the 3 never used, then the least recently used cached one (page 2, b"b")
    assert alloc.lookup([b"a", b"b"]) == [1] and 1 in alloc.pages_of(1) and 1 not in alloc.pages_of(2)
    with pytest.raises(OutOfPages):
        alloc.grow(3, 2)
    alloc.check()


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
