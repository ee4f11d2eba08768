"""A transport for simulated engines (pdserve/engine/simulated.py): a write takes the time the simulated model's KV
would take over a measured link, then goes through the real backend, which moves the simulated pool's few bytes.
Writes queue on the link one at a time, as they share a real one's bandwidth. The measured rate already holds a real
write's own overhead, so the link waits that time less what the real backend's writes have lately taken: a write
then takes the simulated time, not that plus the real backend's (on the CPU, 1-2 ms: +26-35% on a 2.6 ms write)."""

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.transfer.backend import TransferBackend, WriteResult
from pdserve.transfer.errors import TransferTimeout

INNER_MEAN_WEIGHT = 0.2  # of the latest real write in the moving mean the link's wait leaves out


class SimulatedLink:
    def __init__(self, inner: TransferBackend, bytes_per_page: int, seconds_per_page: float):
        """`bytes_per_page`, `seconds_per_page`: of the simulated model's KV (the time already scaled)."""
        self.inner = inner
        self.name = inner.name
        self.bytes_per_page = bytes_per_page
        self.seconds_per_page = seconds_per_page
        self._link = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"simulated-link-{inner.name}")
        self._inner_s = 0.0  # moving mean of the real backend's write time (only the link's thread touches it)

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
            link_s = max(0.0, len(src) * self.seconds_per_page - self._inner_s)
            time.sleep(min(link_s, max(0.0, posted_s + timeout_s - time.monotonic())))
            left_s = posted_s + timeout_s - time.monotonic()
            if left_s <= 0:
                raise TransferTimeout(f"write to {peer!r} not done within {timeout_s} s (simulated link)")
            inner_started_s = time.monotonic()
            moved = self.inner.write(peer, src, dst, notif, left_s, layers).result()
            self._inner_s += INNER_MEAN_WEIGHT * (time.monotonic() - inner_started_s - self._inner_s)
            return WriteResult(len(src) * self.bytes_per_page, moved.num_descriptors, time.monotonic() - posted_s,
                               moved.posting_seconds, moved.queued_seconds, moved.post_call_seconds)

        return self._link.submit(over_the_link)

    def expect_notifications(self, count: int) -> None:
        self.inner.expect_notifications(count)

    def close(self) -> None:
        self._link.shutdown(wait=False, cancel_futures=True)
        self.inner.close()
