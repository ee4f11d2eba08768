"""What every prefill rank holds in its prefix cache, as chained page hashes, for routing by longest cached prefix.

Built from each rank's KV events (exact) plus the router's own recent assignments (a prompt just sent to a rank
will be cached there; counted until its events arrive, at most `pending_ttl_s`).

Resync: batches carry a per-rank `seq` that grows by one. A gap means events were lost, so the rank's entries
are dropped and the subscription restarts with `after=-1`, which asks the worker for a full dump: the first batch
carries a `cleared` event followed by `stored` events for every page the rank holds, with `seq` = the worker's
latest seq, and live batches follow from seq + 1. A batch whose first event is `cleared` is accepted whatever its
seq. Cost: lookup is O(pages of the prompt) set probes; applying an event is O(its hashes).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pdserve.wire.block_hash import prefix_page_hashes
from pdserve.wire.protocol import KVEventBatch

RankKey = tuple[str, int]  # (worker url, rank)
BatchOutcome = Literal["applied", "skipped", "gap"]


@dataclass
class RankIndex:
    page_size: int
    stored: set[int] = field(default_factory=set)
    pending: dict[int, float] = field(default_factory=dict)  # hash -> expiry (monotonic seconds)
    last_seq: int | None = None  # None: waiting for a full dump

    def holds(self, page_hash: int, now: float) -> bool:
        if page_hash in self.stored:
            return True
        expiry = self.pending.get(page_hash)
        return expiry is not None and expiry > now


class PrefixIndex:
    def __init__(self, pending_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self.ranks: dict[RankKey, RankIndex] = {}

    def add_rank(self, key: RankKey, page_size: int) -> None:
        if key not in self.ranks or self.ranks[key].page_size != page_size:
            self.ranks[key] = RankIndex(page_size=page_size)

    def remove_rank(self, key: RankKey) -> None:
        self.ranks.pop(key, None)

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
                rank.stored.clear()
                rank.last_seq = None
                return "gap"
        rank.last_seq = batch.seq
        for event in batch.events:
            if event.kind == "cleared":
                rank.stored.clear()
            elif event.kind == "stored":
                rank.stored.update(event.block_hashes)
                for page_hash in event.block_hashes:
                    rank.pending.pop(page_hash, None)
            elif event.kind == "removed":
                rank.stored.difference_update(event.block_hashes)
        return "applied"

    def mark_lost(self, key: RankKey) -> None:
        """The event stream broke: keep what is known (still mostly true) but ask for a full dump on reconnect."""
        if key in self.ranks:
            self.ranks[key].last_seq = None

    def record_assignment(self, key: RankKey, prompt_token_ids: list[int]) -> None:
        rank = self.ranks.get(key)
        if rank is None:
            return
        now = self.clock()
        expiry = now + self.pending_ttl_s
        for page_hash in prefix_page_hashes(prompt_token_ids, rank.page_size):
            rank.pending[page_hash] = expiry
        if len(rank.pending) > 4 * 65536:  # bound memory under a flood of unique prompts
            rank.pending = {h: e for h, e in rank.pending.items() if e > now}

    def matched_tokens(self, keys: list[RankKey], prompt_token_ids: list[int]) -> dict[RankKey, int]:
        """Per rank, prompt tokens whose pages it holds, counting the contiguous run from the start."""
        now = self.clock()
        hashes_by_page_size: dict[int, list[int]] = {}
        matched: dict[RankKey, int] = {}
        for key in keys:
            rank = self.ranks.get(key)
            if rank is None:
                matched[key] = 0
                continue
            if rank.page_size not in hashes_by_page_size:
                hashes_by_page_size[rank.page_size] = prefix_page_hashes(prompt_token_ids, rank.page_size)
            stored, pending = rank.stored, rank.pending
            matched_pages = 0
            for page_hash in hashes_by_page_size[rank.page_size]:  # RankIndex.holds, inlined: 100s of ranks a call
                if page_hash not in stored and not (pending and pending.get(page_hash, 0.0) > now):
                    break
                matched_pages += 1
            matched[key] = matched_pages * rank.page_size
        return matched

    def expire_pending(self) -> None:
        now = self.clock()
        for rank in self.ranks.values():
            rank.pending = {h: e for h, e in rank.pending.items() if e > now}
