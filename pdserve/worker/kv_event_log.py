"""A rank's recent prefix-cache events, numbered, for routers that subscribe and may fall behind or restart."""

import threading
from collections import deque
from collections.abc import Callable

from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import KVEventBatch

KV_EVENT_HISTORY = 4096  # batches kept for subscribers that fall behind; older gaps get a full dump


class KVEventLog:
    """Recorded on the step thread; the history is read from any thread (a subscriber's answer need not wait for a
    step), a full dump only on the step thread, where the prefix cache it lists lives."""

    def __init__(self, rank: int, history: int = KV_EVENT_HISTORY):
        self.rank = rank
        self._batches: deque[KVEventBatch] = deque(maxlen=history)
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def seq(self) -> int:
        return self._seq

    def record(self, events: list[KVEvent]) -> None:
        with self._lock:
            self._seq += 1
            self._batches.append(KVEventBatch(self.rank, self._seq, events))

    def newer_than(self, seq: int) -> list[KVEventBatch] | None:
        """Batches with seq > `seq` from the history; None when only a full dump will do: `seq` is -1, too old, or
        from before a restart (larger than ours)."""
        with self._lock:
            oldest = self._batches[0].seq if self._batches else self._seq + 1
            if 0 <= seq <= self._seq and seq + 1 >= oldest:
                return [batch for batch in self._batches if batch.seq > seq]
            return None

    def after(self, seq: int, stored_blocks: Callable[[], list[tuple[int, int]]]) -> list[KVEventBatch]:
        """`newer_than(seq)`, or a full dump (cleared + every stored block) where that is None."""
        batches = self.newer_than(seq)
        if batches is not None:
            return batches
        stored = [KVEvent("stored", [block], parent) for parent, block in stored_blocks()]
        return [KVEventBatch(self.rank, self._seq, [KVEvent("cleared"), *stored])]
