"""Host page allocator: which physical KV pages each sequence owns (numpy/Python only, no JAX).

Page 0 is reserved as a scratch page: page tables are padded with it and it is never handed out, so padded
reads are harmless and no real page is ever aliased.  Invariant: free + owned == num_pages - 1, and no page is
owned twice.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """The pool cannot satisfy an allocation right now (the scheduler preempts or waits)."""


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

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self.free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_of(self, owner: int) -> list[int]:
        return self.owned.get(owner, [])

    def can_grow(self, owner: int, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(self.pages_of(owner)) <= self.num_free

    def grow(self, owner: int, num_tokens: int) -> list[int]:
        """Ensure `owner` has pages for `num_tokens` tokens; all-or-nothing (raises OutOfPages)."""
        pages = self.owned.get(owner, [])
        need = self.pages_for(num_tokens) - len(pages)
        if need > len(self.free_pages):
            raise OutOfPages(f"need {need} pages, {len(self.free_pages)} free")
        if need > 0:
            self.owned[owner] = pages + [self.free_pages.pop() for _ in range(need)]
        return self.owned.get(owner, [])

    def free(self, owner: int) -> int:
        """Return all pages of `owner` to the pool; returns how many were freed (0 if it owned none)."""
        pages = self.owned.pop(owner, [])
        self.free_pages.extend(reversed(pages))
        return len(pages)

    def check(self) -> None:
        """Assert the accounting invariants (used by tests and after preemption)."""
        owned = [p for pages in self.owned.values() for p in pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert not set(owned) & set(self.free_pages), "a page is both free and owned"
        assert 0 not in owned and 0 not in self.free_pages, "scratch page 0 was handed out"
        assert len(owned) + len(self.free_pages) == self.num_pages - 1, "pages leaked"
