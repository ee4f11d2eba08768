"""A transport for simulated engines (pdserve/engine/simulated.py): a write takes the time the simulated model's KV
would take over a measured link, then goes through the real backend, which moves the simulated pool's few bytes.
Writes queue on the link one at a time, as they share a real one's bandwidth."""

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.transfer.backend import TransferBackend, WriteResult
from pdserve.transfer.errors import TransferTimeout


class SimulatedLink:
    def __init__(self, inner: TransferBackend, bytes_per_page: int, seconds_per_page: float):
        """`bytes_per_page`, `seconds_per_page`: of the simulated model's KV (the time already scaled)."""
        self.inner = inner
        self.name = inner.name
        self.bytes_per_page = bytes_per_page
        self.seconds_per_page = seconds_per_page
        self._link = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"simulated-link-{inner.name}")

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, blob: bytes) -> Future[str]:
        return self.inner.add_peer(blob)

    def write(self, peer: str, src_page_ids: Sequence[int], dst_page_ids: Sequence[int], notif: bytes,
              timeout_s: float, layers: range | None = None) -> Future[WriteResult]:
        posted_s = time.monotonic()
        src, dst = list(src_page_ids), list(dst_page_ids)

        def over_the_link() -> WriteResult:
            # The simulated pool has one layer that stands for all of the model's: a write moves whole pages.
            time.sleep(min(len(src) * self.seconds_per_page, max(0.0, posted_s + timeout_s - time.monotonic())))
            left_s = posted_s + timeout_s - time.monotonic()
            if left_s <= 0:
                raise TransferTimeout(f"write to {peer!r} not done within {timeout_s} s (simulated link)")
            moved = self.inner.write(peer, src, dst, notif, left_s, layers).result()
            return WriteResult(len(src) * self.bytes_per_page, moved.num_descriptors, time.monotonic() - posted_s)

        return self._link.submit(over_the_link)

    def expect_notifications(self, count: int) -> None:
        self.inner.expect_notifications(count)

    def close(self) -> None:
        self._link.shutdown(wait=False, cancel_futures=True)
        self.inner.close()
