"""The KV transport behind one interface: post a WRITE of pages into a peer's pool, learn of its completion and of
the writes that land in this pool as events (a future, a callback) from a thread of the backend's own.

Backends: NIXL over UCX (`nixl_backend.py`, what ranks use) and in-process (`inprocess.py`: two pools in one
process, a write is a copy plus a notification, with injectable delay and failure, for tests of milliseconds).
"""

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

# (writer's agent name, the notification its write carried); called on the backend's thread, after every byte of
# that write has landed in this pool.
OnNotification = Callable[[str, bytes], None]


@dataclass(frozen=True)
class WriteResult:
    num_bytes: int
    num_descriptors: int  # byte ranges moved: one per run of pages consecutive on both sides
    seconds: float  # from asking for the write to seeing it complete (its wait to be posted included)
    # Of those, from asking until NIXL had the write: the wait for other threads' posts and the descriptors' making
    # (0 where a backend moves the bytes as it is asked).
    posting_seconds: float = 0.0
    queued_seconds: float = 0.0  # of posting_seconds, the wait for another thread's post to the same backend
    post_call_seconds: float = 0.0  # NIXL's post call (after posting_seconds; then the bytes are in flight)


class TransferBackend(Protocol):
    """Thread-safe: every method may be called from any thread and returns without waiting for a transfer."""

    name: str  # unique per start, so that peers learn a restarted rank afresh

    def metadata(self) -> bytes:
        """What a writer needs (`add_peer`) to write into this pool."""
        ...

    def add_peer(self, blob: bytes) -> Future[str]:
        """Learn a peer from its metadata; resolves to its name (a name already known is not learned again)."""
        ...

    def write(self, peer: str, src_page_ids: Sequence[int], dst_page_ids: Sequence[int], notif: bytes,
              timeout_s: float, layers: range | None = None) -> Future[WriteResult]:
        """Write `layers` (all by default) of each src page into the paired dst page of `peer`; the peer is notified
        with `notif` once all bytes landed. Fails with TransferError, or TransferTimeout after `timeout_s` (the write
        is then cancelled)."""
        ...

    def expect_notifications(self, count: int) -> None:
        """How many writes into this pool are awaited now: while any are, the backend listens closely."""
        ...

    def close(self) -> None: ...


def open_nixl_backend(name: str, kv: torch.Tensor, on_notification: OnNotification,
                      progress_thread: bool) -> TransferBackend:
    from pdserve.transfer.nixl_backend import NixlBackend  # imports nixl only when chosen

    return NixlBackend(name, kv, on_notification, progress_thread)
