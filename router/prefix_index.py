"""What every prefill rank holds in its prefix cache, as chained page hashes, for routing by longest cached prefix.

Built from each rank's KV events (exact) plus the router's own recent assignments (a prompt just sent to a rank
will be cached there; counted until its events arrive, at most `pending_ttl_s`).

Layout: each rank has a bit, and for every page hash one mask of the ranks that store it (and one of the ranks it
was just assigned to), per page size. A lookup walks the prompt's pages once, AND-ing masks, and stops at the first
page no rank holds: it touches a few dict entries, not every rank's state, so it stays cheap at hundreds of ranks
and with cold CPU caches. Each rank also keeps its own set of hashes, to clear its bits on a reset.

Resync: batches carry a per-rank `seq` that grows by one. A gap means events were lost, so the rank's entries
are dropped and the subscription restarts with `after=-1`, which asks the worker for a full dump: the first batch
carries a `cleared` event followed by `stored` events for every page the rank holds, with `seq` = the worker's
latest seq, and live batches follow from seq + 1. A batch whose first event is `cleared` is accepted whatever its
seq. Cost: a lookup is O(pages matched + ranks matched); applying an event is O(its hashes).
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pdserve.wire.block_hash import iter_prefix_page_hashes, prefix_page_hashes
from pdserve.wire.protocol import KVEventBatch

RankKey = tuple[str, int]  # (worker url, rank)
BatchOutcome = Literal["applied", "skipped", "gap"]

# Assignments whose pending pages are remembered at once; beyond it the oldest are forgotten before their expiry,
# which bounds memory under a flood of unique prompts.
MAX_PENDING_ASSIGNMENTS = 65536


@dataclass
class RankIndex:
    page_size: int
    bit: int  # this rank's bit (a power of two) in the holder masks
    stored: set[int] = field(default_factory=set)
    pending: dict[int, float] = field(default_factory=dict)  # hash -> expiry (monotonic seconds)
    last_seq: int | None = None  # None: waiting for a full dump


class HolderMasks(dict[int, int]):
    """page hash -> mask of the ranks holding the page; a page no rank holds has no entry."""

    def add(self, page_hash: int, bit: int) -> None:
        self[page_hash] = self.get(page_hash, 0) | bit

    def discard(self, page_hash: int, bit: int) -> None:
        mask = self.get(page_hash, 0) & ~bit
        if mask:
            self[page_hash] = mask
        else:
            self.pop(page_hash, None)


@dataclass
class PageSizeTable:
    """The holder masks of the ranks of one page size (their hashes differ from other page sizes')."""

    stored: HolderMasks = field(default_factory=HolderMasks)
    pending: HolderMasks = field(default_factory=HolderMasks)


class PrefixIndex:
    def __init__(self, pending_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self.ranks: dict[RankKey, RankIndex] = {}
        self._tables: dict[int, PageSizeTable] = {}
        self._key_of_bit: dict[int, RankKey] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._assignments: deque[tuple[float, RankKey, list[int]]] = deque()  # (expiry, rank, hashes), oldest first

    def add_rank(self, key: RankKey, page_size: int) -> None:
        if key in self.ranks and self.ranks[key].page_size == page_size:
            return
        self.remove_rank(key)
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit << 1
        self.ranks[key] = RankIndex(page_size=page_size, bit=bit)
        self._key_of_bit[bit] = key
        self._tables.setdefault(page_size, PageSizeTable())

    def remove_rank(self, key: RankKey) -> None:
        rank = self.ranks.pop(key, None)
        if rank is None:
            return
        table = self._tables[rank.page_size]
        self._clear_stored(rank)
        for page_hash in rank.pending:
            table.pending.discard(page_hash, rank.bit)
        del self._key_of_bit[rank.bit]
        self._free_bits.append(rank.bit)

    def subscribe_after(self, key: RankKey) -> int:
        """The `after` to subscribe with: the last seq applied, or -1 for a full dump."""
        rank = self.ranks[key]
        return -1 if rank.last_seq is None else rank.last_seq

    def apply(self, key: RankKey, batch: KVEventBatch) -> BatchOutcome:
        """Apply one batch. "skipped": nothing changed (an unknown rank, a replay, or a live batch while waiting for
        the full dump); "gap": a seq gap was seen, the rank was emptied and must resubscribe with after=-1."""
        rank = self.ranks.get(key)
        if rank is None:
            return "skipped"
        starts_dump = bool(batch.events) and batch.events[0].kind == "cleared"
        if not starts_dump:
            if rank.last_seq is None:
                return "skipped"  # still waiting for the dump; live batches before it are already in it
            if batch.seq <= rank.last_seq:
                return "skipped"  # a replay of something applied
            if batch.seq != rank.last_seq + 1:
                self._clear_stored(rank)
                rank.last_seq = None
                return "gap"
        rank.last_seq = batch.seq
        table, bit, stored, pending = self._tables[rank.page_size], rank.bit, rank.stored, rank.pending
        for event in batch.events:
            if event.kind == "cleared":
                self._clear_stored(rank)
            elif event.kind == "stored":
                for page_hash in event.block_hashes:
                    if page_hash not in stored:
                        stored.add(page_hash)
                        table.stored.add(page_hash, bit)
                    if pending.pop(page_hash, None) is not None:
                        table.pending.discard(page_hash, bit)
            elif event.kind == "removed":
                for page_hash in event.block_hashes:
                    if page_hash in stored:
                        stored.discard(page_hash)
                        table.stored.discard(page_hash, bit)
        return "applied"

    def mark_lost(self, key: RankKey) -> None:
        """The event stream broke: keep what is known (still mostly true) but ask for a full dump on reconnect."""
        if key in self.ranks:
            self.ranks[key].last_seq = None

    def record_assignment(self, key: RankKey, prompt_token_ids: list[int]) -> None:
        rank = self.ranks.get(key)
        if rank is None:
            return
        expiry = self.clock() + self.pending_ttl_s
        hashes = prefix_page_hashes(prompt_token_ids, rank.page_size)
        table = self._tables[rank.page_size]
        for page_hash in hashes:
            rank.pending[page_hash] = expiry
            table.pending.add(page_hash, rank.bit)
        self._assignments.append((expiry, key, hashes))
        if len(self._assignments) > MAX_PENDING_ASSIGNMENTS:
            self._forget_assignment()

    def matched_tokens(self, prompt_token_ids: list[int]) -> dict[RankKey, int]:
        """Prompt tokens each rank holds, counting the contiguous run of pages from the start; ranks that hold not
        even the first page are left out (they match 0)."""
        self.expire_pending()
        matched: dict[RankKey, int] = {}
        for page_size, table in self._tables.items():
            stored, pending = table.stored, table.pending
            alive, pages = -1, 0  # the ranks holding every page so far (all of them before the first), and those pages
            for page_hash in iter_prefix_page_hashes(prompt_token_ids, page_size):
                holding = alive & (stored.get(page_hash, 0) | pending.get(page_hash, 0))
                if holding != alive and pages:
                    self._credit(matched, alive & ~holding, pages * page_size)
                alive = holding
                if not alive:
                    break
                pages += 1
            if alive and pages:
                self._credit(matched, alive, pages * page_size)
        return matched

    def expire_pending(self) -> None:
        now = self.clock()
        while self._assignments and self._assignments[0][0] <= now:
            self._forget_assignment()

    def _credit(self, matched: dict[RankKey, int], mask: int, tokens: int) -> None:
        while mask:
            bit = mask & -mask
            matched[self._key_of_bit[bit]] = tokens
            mask ^= bit

    def _forget_assignment(self) -> None:
        expiry, key, hashes = self._assignments.popleft()
        rank = self.ranks.get(key)
        if rank is None:
            return
        table = self._tables[rank.page_size]
        for page_hash in hashes:
            if rank.pending.get(page_hash) == expiry:  # not renewed by a later assignment, nor stored since
                del rank.pending[page_hash]
                table.pending.discard(page_hash, rank.bit)

    def _clear_stored(self, rank: RankIndex) -> None:
        table = self._tables[rank.page_size]
        for page_hash in rank.stored:
            table.stored.discard(page_hash, rank.bit)
        rank.stored.clear()
