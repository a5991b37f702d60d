"""Host page allocator: which physical KV pages each sequence owns, and the prefix cache over them (numpy/Python
only, no JAX).

Page 0 is reserved as a scratch page: page tables are padded with it and it is never handed out, so padded
reads are harmless and no real page is ever aliased.

Prefix caching (vLLM's automatic prefix caching, the same design): a full page whose rows are final can be
`register`ed under a hash of its tokens and of every token before it (`page_hashes`).  A later sequence whose
prompt starts with the same tokens `share`s those pages instead of computing them: a page is then owned by several
sequences (reference-counted) and nobody writes it again (a sequence writes only at positions past what it shares).
When its last owner frees it, a registered page keeps its rows and its hash: it is *cached*, counted as free, and
handed out again, least recently used first, only when no never-used page is left (its hash is then forgotten).

Invariants (`check`): every page is exactly one of scratch (0), free, cached or owned; a page is cached iff it is
registered and owned by nobody; an owned page's reference count is the number of its owners.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class OutOfPages(RuntimeError):
    """The pool cannot satisfy an allocation right now (the scheduler preempts or waits)."""


def page_hashes(token_ids, page_size: int, first: int, stop: int, lookahead: bool = False,
                parent: bytes = b"") -> list[bytes]:
    """Chained hashes of full pages first .. stop - 1 of `token_ids`: page i's hash names tokens [0, (i + 1) *
    page_size) (and, with `lookahead`, the token after them, for caches whose rows pair a position with its next
    token, as EAGLE-3's do); `parent` is the hash of page first - 1 (b"" for page 0)."""
    if len(token_ids) < stop * page_size + int(lookahead):
        raise ValueError(f"{len(token_ids)} tokens cannot name {stop} pages of {page_size}"
                         + (" and the token after them" if lookahead else ""))
    ids = np.asarray(token_ids[first * page_size:stop * page_size + int(lookahead)], np.int64)
    out = []
    for i in range(stop - first):
        piece = ids[i * page_size:(i + 1) * page_size + int(lookahead)]
        parent = hashlib.blake2b(parent + piece.tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.free_pages: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self.owned: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}  # owned page -> number of owners
        self.page_of_hash: dict[bytes, int] = {}  # registered pages (owned or cached)
        self.hash_of_page: dict[int, bytes] = {}
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recently freed first

    @property
    def num_free(self) -> int:
        """Pages a sequence can get now: never-used ones and cached ones (evicted on the way)."""
        return len(self.free_pages) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_of(self, owner: int) -> list[int]:
        return self.owned.get(owner, [])

    def can_grow(self, owner: int, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(self.pages_of(owner)) <= self.num_free

    def _take(self) -> int:
        if self.free_pages:
            return self.free_pages.pop()
        page, _ = self.cached.popitem(last=False)  # evict the least recently used cached page
        del self.page_of_hash[self.hash_of_page.pop(page)]
        return page

    def grow(self, owner: int, num_tokens: int) -> list[int]:
        """Ensure `owner` has pages for `num_tokens` tokens; all-or-nothing (raises OutOfPages)."""
        pages = self.owned.get(owner, [])
        need = self.pages_for(num_tokens) - len(pages)
        if need > self.num_free:
            raise OutOfPages(f"need {need} pages, {self.num_free} free")
        if need > 0:
            new = [self._take() for _ in range(need)]
            self.refs.update((p, 1) for p in new)
            self.owned[owner] = pages + new
        return self.owned.get(owner, [])

    def free(self, owner: int) -> int:
        """Drop `owner`'s pages; returns how many it held.  A page nobody else owns becomes free, or cached if it
        is registered (the last pages of a sequence are the most recently used: they are evicted last)."""
        pages = self.owned.pop(owner, [])
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                if page in self.hash_of_page:
                    self.cached[page] = None
                else:
                    self.free_pages.append(page)
        return len(pages)

    # ------------------------------------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The registered pages of the longest prefix of `hashes` (changes nothing)."""
        pages = []
        for h in hashes:
            page = self.page_of_hash.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def share(self, owner: int, pages: list[int]) -> None:
        """Give `owner` (which owns nothing yet) registered `pages` (from `lookup`) as its first pages."""
        if self.owned.get(owner):
            raise ValueError(f"owner {owner} already owns pages: shared pages must come first")
        for page in pages:
            if page in self.cached:
                del self.cached[page]
            self.refs[page] = self.refs.get(page, 0) + 1
        if pages:
            self.owned[owner] = list(pages)

    def register(self, owner: int, index: int, page_hash: bytes) -> None:
        """Record that `owner`'s page `index` holds the final rows of the prefix `page_hash` names.  A prefix that
        another page holds already keeps that page (two requests prefilled the same prompt at once)."""
        page = self.owned[owner][index]
        if page_hash not in self.page_of_hash and page not in self.hash_of_page:
            self.page_of_hash[page_hash] = page
            self.hash_of_page[page] = page_hash

    def check(self) -> None:
        """Assert the accounting invariants (used by tests and after preemption)."""
        owned = {p for pages in self.owned.values() for p in pages}
        for pages in self.owned.values():
            assert len(pages) == len(set(pages)), "a sequence owns a page twice"
        counts = collections.Counter(p for pages in self.owned.values() for p in pages)
        assert counts == collections.Counter(self.refs), "reference counts differ from the owners"
        free, cached = set(self.free_pages), set(self.cached)
        assert len(free) == len(self.free_pages), "a page is free twice"
        assert not (owned & free) and not (owned & cached) and not (free & cached), "a page is in two states"
        assert 0 not in owned | free | cached, "scratch page 0 was handed out"
        assert len(owned) + len(free) + len(cached) == self.num_pages - 1, "pages leaked"
        assert cached <= set(self.hash_of_page) and set(self.hash_of_page) <= owned | cached, "a stale hash"
        assert {p: h for h, p in self.page_of_hash.items()} == self.hash_of_page, "hash maps disagree"
