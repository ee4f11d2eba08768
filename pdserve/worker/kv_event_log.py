"""A rank's recent prefix-cache events, numbered, for routers that subscribe and may fall behind or restart."""

from collections import deque
from collections.abc import Callable

from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import KVEventBatch

KV_EVENT_HISTORY = 4096  # batches kept for subscribers that fall behind; older gaps get a full dump


class KVEventLog:
    def __init__(self, rank: int, history: int = KV_EVENT_HISTORY):
        self.rank = rank
        self._batches: deque[KVEventBatch] = deque(maxlen=history)
        self._seq = 0

    def record(self, events: list[KVEvent]) -> None:
        self._seq += 1
        self._batches.append(KVEventBatch(self.rank, self._seq, events))

    def after(self, seq: int, stored_blocks: Callable[[], list[tuple[int, int]]]) -> list[KVEventBatch]:
        """Batches with seq > `seq`; a full dump (cleared + every stored block) when `seq` is -1, too old, or from
        before a restart (larger than ours)."""
        oldest = self._batches[0].seq if self._batches else self._seq + 1
        if 0 <= seq <= self._seq and seq + 1 >= oldest:
            return [batch for batch in self._batches if batch.seq > seq]
        stored = [KVEvent("stored", [block], parent) for parent, block in stored_blocks()]
        return [KVEventBatch(self.rank, self._seq, [KVEvent("cleared"), *stored])]
