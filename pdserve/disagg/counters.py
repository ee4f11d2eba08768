"""Cumulative figures of a rank's hand-offs, which the worker turns into Prometheus metrics."""

from dataclasses import dataclass, field


@dataclass
class HandoffCounters:
    kv_transfer_bytes: int = 0
    kv_transfer_descriptors: int = 0  # byte ranges written: bytes / descriptors says how fragmented the pages were
    kv_transfer_failures: int = 0
    kv_transfer_posting_seconds: float = 0.0  # summed over writes: asking for each until NIXL had it
    kv_transfer_queued_seconds: float = 0.0  # of those, waiting for another thread's post
    kv_transfer_post_call_seconds: float = 0.0  # summed: NIXL's post calls
    kv_transfer_seconds: list[float] = field(default_factory=list)  # one per write, drained by each metrics read
    reservations_refused: int = 0  # reservation queries with an unknown request, a wrong token, or asked twice
    notifications_rejected: int = 0  # KV notifications for no reservation awaiting one (late, forged, duplicate)

    def drain(self) -> "HandoffCounters":
        """A copy for the metrics reader; the per-write seconds go to it and start anew here."""
        copy = HandoffCounters(self.kv_transfer_bytes, self.kv_transfer_descriptors, self.kv_transfer_failures,
                               self.kv_transfer_posting_seconds, self.kv_transfer_queued_seconds,
                               self.kv_transfer_post_call_seconds, self.kv_transfer_seconds, self.reservations_refused,
                               self.notifications_rejected)
        self.kv_transfer_seconds = []
        return copy
