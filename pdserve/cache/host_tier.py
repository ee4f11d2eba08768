"""The prefix cache's second tier: full pages the device pool evicted, kept in host memory by their chained hash.

A prompt whose prefix runs on past what the device tree still holds gets those pages copied back instead of
recomputed. Pure bookkeeping: the bytes move through two callables the engine gives, which enqueue the copies on the
step's stream, so each copy runs after every step launched before it and before every step launched after it.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.wire.block_hash import page_hash

# (source ids, destination ids): device page ids -> host slots, or host slots -> device page ids, copied in order.
CopyPages = Callable[[list[int], list[int]], None]


@dataclass(frozen=True)
class EvictedPage:
    """A page leaving the device tree, still intact until the caller reuses its id."""

    block_hash: int
    parent_hash: int
    page_tokens: tuple[int, ...]
    page_id: int


@dataclass(frozen=True)
class _HostPage:
    slot: int
    parent_hash: int
    page_tokens: tuple[int, ...]


class HostTier:
    """`num_slots` host pages, least recently used dropped first; a page loaded back stays here too, so evicting it
    from the device again copies nothing."""

    def __init__(self, num_slots: int, to_host: CopyPages, to_device: CopyPages):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._to_host, self._to_device = to_host, to_device
        self._pages: OrderedDict[int, _HostPage] = OrderedDict()  # block hash -> page, least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped lowest first
        self._pinned: set[int] = set()  # hashes a load in progress needs; never dropped meanwhile
        self.offloaded_pages = 0  # pages copied in, over the tier's life
        self.loaded_pages = 0  # pages copied back to the device

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._pages

    def keep(self, evicted: Sequence[EvictedPage]) -> list[int]:
        """Copy pages the device evicts into host slots (dropping least recently used pages for room); returns the
        hashes that left the tier or could not enter it (every slot pinned)."""
        dropped: list[int] = []
        page_ids: list[int] = []
        slots: list[int] = []
        new_pages = []  # touched first, so that making room for the others never drops one of these
        for page in evicted:
            if page.block_hash in self._pages:  # loaded back before: the host copy holds the same KV
                self._pages.move_to_end(page.block_hash)
            else:
                new_pages.append(page)
        for page in new_pages:
            if not self._free_slots and not self._drop_least_recent(dropped):
                dropped.append(page.block_hash)
                continue
            slot = self._free_slots.pop()
            self._pages[page.block_hash] = _HostPage(slot, page.parent_hash, page.page_tokens)
            page_ids.append(page.page_id)
            slots.append(slot)
        if page_ids:
            # A slot dropped and refilled within this call is written twice, in list order: the later page wins.
            self._to_host(page_ids, slots)
            self.offloaded_pages += len(page_ids)
        return dropped

    def find(self, parent_hash: int, token_ids: Sequence[int], first_page: int, page_size: int) -> list[int]:
        """Hashes of the pages held here that continue a prefix from page `first_page` of `token_ids` (whose page
        before hashes to `parent_hash`), in order; each is marked used now. A page's tokens are compared too, so a
        hash collision cannot hand back another prefix's KV."""
        found: list[int] = []
        for start in range(first_page * page_size, len(token_ids) - page_size + 1, page_size):
            page_tokens = tuple(map(int, token_ids[start : start + page_size]))
            block_hash = page_hash(parent_hash, list(page_tokens))
            page = self._pages.get(block_hash)
            if page is None or page.page_tokens != page_tokens or page.parent_hash != parent_hash:
                break
            self._pages.move_to_end(block_hash)
            found.append(block_hash)
            parent_hash = block_hash
        return found

    @contextmanager
    def pinned(self, block_hashes: Sequence[int]) -> Iterator[None]:
        """Keep these pages while the caller makes room on the device for them (which may evict into this tier)."""
        self._pinned.update(block_hashes)
        try:
            yield
        finally:
            self._pinned.difference_update(block_hashes)

    def load(self, block_hashes: Sequence[int], page_ids: Sequence[int]) -> None:
        """Copy the pages of `block_hashes` into device pages `page_ids`, one for one."""
        self._to_device([self._pages[block_hash].slot for block_hash in block_hashes], list(page_ids))
        self.loaded_pages += len(block_hashes)

    def stored_blocks(self) -> list[tuple[int, int]]:
        """(parent_hash, block_hash) of every page held here."""
        return [(page.parent_hash, block_hash) for block_hash, page in self._pages.items()]

    def clear(self) -> None:
        self._pages.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))

    def check_integrity(self) -> None:
        """Raise AssertionError if a slot is held twice, or held and free at once, or lost."""
        held = [page.slot for page in self._pages.values()]
        if len(set(held)) != len(held) or set(held) & set(self._free_slots) \
                or len(held) + len(self._free_slots) != self.num_slots:
            raise AssertionError(f"host slots: {len(held)} held, {len(self._free_slots)} free of {self.num_slots}")

    def _drop_least_recent(self, dropped: list[int]) -> bool:
        """Free the slot of the least recently used unpinned page, recording its hash; False if every page is pinned."""
        for block_hash in self._pages:
            if block_hash not in self._pinned:
                self._free_slots.append(self._pages.pop(block_hash).slot)
                dropped.append(block_hash)
                return True
        return False
