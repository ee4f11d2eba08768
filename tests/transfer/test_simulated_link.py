"""The simulated link: a write takes pages x the simulated page's write time, queues behind the writes before it,
then lands through the real backend (whose own time comes out of the link's wait); one that cannot finish in time
fails before it moves anything."""

import time

import pytest
import torch

from pdserve.transfer.errors import TransferTimeout
from pdserve.transfer.inprocess import InProcessBackend, InProcessFabric
from pdserve.transfer.simulated_link import SimulatedLink

SECONDS_PER_PAGE, BYTES_PER_PAGE = 0.05, 1_990_656  # 64 tokens of V2-Lite KV
WAIT_S = 10.0


def linked_pair():
    fabric = InProcessFabric()
    notified: list[bytes] = []
    writer_kv = torch.arange(8 * 4, dtype=torch.uint8).view(1, 8, 4, 1)
    reader_kv = torch.zeros(1, 8, 4, 1, dtype=torch.uint8)
    writer = SimulatedLink(InProcessBackend("w", writer_kv, lambda *_: None, fabric), BYTES_PER_PAGE, SECONDS_PER_PAGE)
    reader = InProcessBackend("r", reader_kv, lambda _, payload: notified.append(payload), fabric)
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    return writer, reader, peer, notified


def test_writes_take_the_simulated_time_queue_on_the_link_and_land_exactly():
    writer, reader, peer, notified = linked_pair()
    started = time.monotonic()
    first = writer.write(peer, [0, 1, 2], [4, 5, 6], b"first", timeout_s=WAIT_S)
    second = writer.write(peer, [3], [7], b"second", timeout_s=WAIT_S)
    result = first.result(WAIT_S)
    assert time.monotonic() - started >= 3 * SECONDS_PER_PAGE
    assert result.num_bytes == 3 * BYTES_PER_PAGE and result.seconds >= 3 * SECONDS_PER_PAGE
    second.result(WAIT_S)
    assert time.monotonic() - started >= 4 * SECONDS_PER_PAGE  # it waited for the first on the link
    assert torch.equal(reader.kv[0, 4:8], writer.inner.kv[0, 0:4])
    assert notified == [b"first", b"second"]
    writer.close()
    reader.close()


def test_a_write_the_link_cannot_finish_in_time_times_out_and_moves_nothing():
    writer, reader, peer, notified = linked_pair()
    with pytest.raises(TransferTimeout):
        writer.write(peer, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], b"late", timeout_s=0.1).result(WAIT_S)
    assert not reader.kv.any() and notified == []
    writer.close()
    reader.close()


class SlowBackend(InProcessBackend):
    """A real backend whose every write takes INNER_S more: a CPU backend's own overhead, exaggerated."""

    INNER_S = 0.2

    def write(self, *args, **kwargs):
        time.sleep(self.INNER_S)
        return super().write(*args, **kwargs)


def test_the_real_backends_own_time_comes_out_of_the_simulated_wait():
    fabric = InProcessFabric()
    kv = torch.zeros(1, 8, 4, 1, dtype=torch.uint8)
    pages = 5  # 0.25 s simulated per write, against 0.2 s of the real backend's own
    writer = SimulatedLink(SlowBackend("w", kv.clone(), lambda *_: None, fabric), BYTES_PER_PAGE, SECONDS_PER_PAGE)
    reader = InProcessBackend("r", kv.clone(), lambda *_: None, fabric)
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    seconds = [writer.write(peer, list(range(pages)), list(range(pages)), b"n", timeout_s=WAIT_S).result(WAIT_S).seconds
               for _ in range(10)]
    assert seconds[0] >= pages * SECONDS_PER_PAGE + SlowBackend.INNER_S  # nothing known of the backend yet
    assert all(s >= pages * SECONDS_PER_PAGE for s in seconds)  # never faster than simulated: the mean stays below
    assert seconds[-1] < pages * SECONDS_PER_PAGE + SlowBackend.INNER_S / 2  # 0.25 + 0.2 at first, ~0.28 by the 10th
    writer.close()
    reader.close()
