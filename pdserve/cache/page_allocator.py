"""Reference-counted page ids of one rank's KV pool: which pages are free and who still holds the rest."""

import heapq
from collections import Counter
from collections.abc import Iterable


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens (the last one possibly partly filled)."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """Hands out page ids; a page is free exactly when its reference count is 0.

    Pages go out lowest id first, in ascending order: a request's pages then form long runs of consecutive ids,
    which a KV transfer moves with one descriptor per run and layer instead of one per page (a free list used as
    a stack handed freed pages back in descending order: one descriptor per page, ~12 GB/s instead of ~200 on an
    NVLink pair). Each operation costs O(log pages) per page, plus validating the whole request first, so a bad
    call changes nothing.
    """

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._free_page_ids = list(range(num_pages))  # a min-heap (sorted is one)

    @property
    def num_free(self) -> int:
        return len(self._free_page_ids)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free_page_ids)

    def alloc(self, n: int) -> list[int] | None:
        """`n` free pages with reference count 1 each, or None (taking nothing) if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"alloc expects n >= 0, got {n}")
        if n > len(self._free_page_ids):
            return None
        page_ids = [heapq.heappop(self._free_page_ids) for _ in range(n)]
        for page_id in page_ids:
            self._refcounts[page_id] = 1
        return page_ids

    def incref(self, page_ids: Iterable[int]) -> None:
        """Add one reference to each listed page (repeats count twice); every page must be allocated."""
        page_ids = list(page_ids)
        for page_id in page_ids:
            self._check_in_use(page_id, "incref")
        for page_id in page_ids:
            self._refcounts[page_id] += 1

    def decref(self, page_ids: Iterable[int]) -> None:
        """Drop one reference from each listed page; a page whose count reaches 0 goes back to the free list."""
        page_ids = list(page_ids)
        for page_id, drops in Counter(page_ids).items():
            self._check_in_use(page_id, "decref")
            if drops > self._refcounts[page_id]:
                raise ValueError(
                    f"decref of page {page_id} {drops} times, but its reference count is {self._refcounts[page_id]}"
                )
        for page_id in page_ids:
            self._refcounts[page_id] -= 1
            if self._refcounts[page_id] == 0:
                heapq.heappush(self._free_page_ids, page_id)

    def refcount(self, page_id: int) -> int:
        self._check_id(page_id)
        return self._refcounts[page_id]

    def _check_id(self, page_id: int) -> None:
        if not isinstance(page_id, int) or not 0 <= page_id < self.num_pages:
            raise ValueError(f"page id must be an int in [0, {self.num_pages}), got {page_id!r}")

    def _check_in_use(self, page_id: int, operation: str) -> None:
        self._check_id(page_id)
        if self._refcounts[page_id] == 0:
            raise ValueError(f"{operation} of page {page_id} expects an allocated page, but it is free")
