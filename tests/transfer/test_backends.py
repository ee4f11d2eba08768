"""Both transfer backends behind one interface: a write lands exactly and notifies once, completion and
notification arrive as events from the backend's thread (nobody polls), a dead peer fails the write. NIXL moves real
bytes between two agents of this process; the in-process backend also injects delay, failure and lost notices."""

import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.transfer.backend import open_nixl_backend
from pdserve.transfer.errors import TransferError, TransferTimeout
from pdserve.transfer.inprocess import InjectedFaults, InProcessBackend, InProcessFabric

NUM_LAYERS, PAGE_SIZE, KV_DIM = 3, 4, 16
WAIT_S = 10.0


def pool(num_pages: int, seed: int) -> torch.Tensor:
    # page-major, seen layer-first, as an engine's pool (pdserve.ops.attention.new_kv_pool)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, NUM_LAYERS, PAGE_SIZE, KV_DIM, generator=generator).transpose(0, 1)


class Notifications:
    """What a backend's thread delivered, with the thread it came on."""

    def __init__(self) -> None:
        self.received: queue.Queue[tuple[str, bytes, str]] = queue.Queue()

    def __call__(self, writer: str, payload: bytes) -> None:
        self.received.put((writer, payload, threading.current_thread().name))

    def next(self) -> tuple[str, bytes, str]:
        return self.received.get(timeout=WAIT_S)


@pytest.fixture(params=["nixl", "inprocess"])
def pair(request):
    """(writer backend, reader backend, reader's notifications, reader pool, fabric or None)."""
    fabric = InProcessFabric()
    notifications = Notifications()
    writer_kv, reader_kv = pool(12, seed=0), pool(20, seed=1)
    suffix = uuid.uuid4().hex[:8]

    def make(name, kv, on_notification):
        if request.param == "nixl":
            return open_nixl_backend(name, kv, on_notification, progress_thread=False)
        return InProcessBackend(name, kv, on_notification, fabric)

    writer = make(f"writer-{suffix}", writer_kv, lambda *_: None)
    reader = make(f"reader-{suffix}", reader_kv, notifications)
    yield writer, reader, notifications, writer_kv, reader_kv, (fabric if request.param == "inprocess" else None)
    writer.close()
    reader.close()


def test_a_write_lands_exactly_and_notifies_once_from_the_backend_thread(pair):
    writer, reader, notifications, writer_kv, reader_kv, _ = pair
    expected = reader_kv.clone()
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    assert peer == reader.name
    reader.expect_notifications(1)
    src, dst = [0, 1, 2, 7], [3, 4, 5, 19]
    result = writer.write(peer, src, dst, b"req-1", timeout_s=WAIT_S).result(WAIT_S)
    writer_name, payload, thread_name = notifications.next()
    assert (writer_name, payload) == (writer.name, b"req-1")
    assert thread_name.startswith("kv-transfer-")
    assert result.num_bytes == len(src) * NUM_LAYERS * PAGE_SIZE * KV_DIM * 4
    assert result.num_descriptors == 2  # runs 0-2 -> 3-5 and 7 -> 19, each with every layer in one range
    assert 0.0 <= result.queued_seconds <= result.posting_seconds
    assert 0.0 <= result.post_call_seconds and result.posting_seconds + result.post_call_seconds <= result.seconds
    expected[:, dst] = writer_kv[:, src]
    assert torch.equal(reader_kv, expected)
    assert notifications.received.empty()


def test_writes_asked_from_several_threads_at_once_each_land_exactly_and_notify_once(pair):
    """Callers post their writes themselves (the NIXL backend one post at a time): six threads writing at once, each
    its own pages, while the backend's thread watches the others complete."""
    writer, reader, notifications, writer_kv, reader_kv, _ = pair
    expected = reader_kv.clone()
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    reader.expect_notifications(6)
    start = threading.Barrier(6)

    def write(index: int):
        start.wait(WAIT_S)
        src, dst = [2 * index, 2 * index + 1], [19 - 2 * index, 18 - 2 * index]  # page runs that go backwards
        return writer.write(peer, src, dst, f"req-{index}".encode(), timeout_s=WAIT_S).result(WAIT_S), src, dst

    with ThreadPoolExecutor(6) as threads:
        written = list(threads.map(write, range(6)))
    for result, src, dst in written:
        assert result.num_bytes == 2 * NUM_LAYERS * PAGE_SIZE * KV_DIM * 4
        expected[:, dst] = writer_kv[:, src]
    assert sorted(notifications.next()[1] for _ in range(6)) == [f"req-{i}".encode() for i in range(6)]
    assert torch.equal(reader_kv, expected)
    assert notifications.received.empty()


def test_every_write_is_seen_complete_while_others_complete_as_it_is_handed_over(pair):
    """Hundreds of writes posted back to back, so that the backend's thread takes its finished writes out while new
    ones are being handed to it: each resolves (a write lost in that hand-over would hang its request for ever)."""
    writer, reader, notifications, _, _, _ = pair
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    reader.expect_notifications(300)
    futures = [writer.write(peer, [index % 12], [index % 20], b"n", timeout_s=WAIT_S) for index in range(300)]
    assert all(future.result(WAIT_S).num_bytes > 0 for future in futures)
    assert [notifications.next()[1] for _ in range(300)] == [b"n"] * 300


def test_a_layer_range_moves_only_those_layers(pair):
    writer, reader, notifications, writer_kv, reader_kv, _ = pair
    expected = reader_kv.clone()
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    writer.write(peer, [11], [0], b"layer-1", timeout_s=WAIT_S, layers=range(1, 2)).result(WAIT_S)
    assert notifications.next()[1] == b"layer-1"
    expected[1, 0] = writer_kv[1, 11]
    assert torch.equal(reader_kv, expected)


def test_writing_no_pages_still_notifies(pair):
    writer, reader, notifications, *_ = pair
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    assert writer.write(peer, [], [], b"all-cached", timeout_s=WAIT_S).result(WAIT_S).num_bytes == 0
    assert notifications.next()[1] == b"all-cached"


def test_a_write_to_an_unknown_peer_fails(pair):
    writer, *_ = pair
    with pytest.raises(TransferError, match="unknown"):
        writer.write("nobody", [0], [0], b"x", timeout_s=WAIT_S).result(WAIT_S)


def test_a_write_to_a_peer_that_left_fails_and_moves_nothing():
    fabric, kept = InProcessFabric(), pool(20, seed=1)
    writer = InProcessBackend("w", pool(12, seed=0), lambda *_: None, fabric)
    reader = InProcessBackend("r", kept.clone(), lambda *_: None, fabric)
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    reader.close()  # the decode rank died
    with pytest.raises(TransferError, match="unknown|disconnected"):
        writer.write(peer, [0], [0], b"lost", timeout_s=WAIT_S).result(WAIT_S)
    assert torch.equal(reader.kv, kept)
    writer.close()


@pytest.mark.parametrize("fault, error", [
    (InjectedFaults(write_delay_s=0.5), TransferTimeout),
    (InjectedFaults(write_error="link down"), TransferError),
])
def test_injected_faults_fail_the_write_and_move_nothing(fault, error):
    fabric, kept = InProcessFabric(), pool(20, seed=1)
    notifications = Notifications()
    writer = InProcessBackend("w", pool(12, seed=0), lambda *_: None, fabric, fault)
    reader = InProcessBackend("r", kept.clone(), notifications, fabric)
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    with pytest.raises(error):
        writer.write(peer, [0, 1], [5, 6], b"x", timeout_s=0.2).result(WAIT_S)
    assert torch.equal(reader.kv, kept) and notifications.received.empty()
    writer.close()
    reader.close()


def test_a_lost_notification_still_moves_the_bytes():
    fabric = InProcessFabric()
    notifications = Notifications()
    writer = InProcessBackend("w", pool(12, seed=0), lambda *_: None, fabric, InjectedFaults(drop_notifications=True))
    reader = InProcessBackend("r", pool(20, seed=1), notifications, fabric)
    peer = writer.add_peer(reader.metadata()).result(WAIT_S)
    writer.write(peer, [2], [9], b"x", timeout_s=WAIT_S).result(WAIT_S)
    assert torch.equal(reader.kv[:, 9], writer.kv[:, 2]) and notifications.received.empty()
    writer.close()
    reader.close()


def test_a_peer_with_another_page_shape_is_refused():
    fabric = InProcessFabric()
    writer = InProcessBackend("w", pool(12, seed=0), lambda *_: None, fabric)
    other_model = torch.zeros(4, NUM_LAYERS, PAGE_SIZE, KV_DIM * 2).transpose(0, 1)
    other = InProcessBackend("o", other_model, lambda *_: None, fabric)
    with pytest.raises(ValueError, match="not the same model"):
        writer.add_peer(other.metadata()).result(WAIT_S)
    writer.close()
    other.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("progress_thread", [True, False], ids=["progress-thread", "transfer-thread-only"])
def test_a_vram_write_lands_exactly_on_the_gpu(progress_thread):
    reader_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    writer_kv, reader_kv = pool(12, seed=0).cuda(), pool(20, seed=1).to(reader_device)
    expected = reader_kv.clone()
    notifications = Notifications()
    writer = open_nixl_backend(f"w-{uuid.uuid4().hex[:8]}", writer_kv, lambda *_: None, progress_thread)
    reader = open_nixl_backend(f"r-{uuid.uuid4().hex[:8]}", reader_kv, notifications, progress_thread)
    try:
        peer = writer.add_peer(reader.metadata()).result(WAIT_S)
        reader.expect_notifications(1)
        writer.write(peer, [0, 1, 2, 9], [4, 5, 6, 0], b"vram", timeout_s=WAIT_S).result(WAIT_S)
        assert notifications.next()[1] == b"vram"
        expected[:, [4, 5, 6, 0]] = writer_kv[:, [0, 1, 2, 9]].to(reader_device)
        assert torch.equal(reader_kv, expected)
    finally:
        writer.close()
        reader.close()


@pytest.fixture
def nixl_pair():
    """(writer, reader's notifications, the reader as the writer's peer): NIXL backends awaiting one write."""
    notifications = Notifications()
    suffix = uuid.uuid4().hex[:8]
    writer = open_nixl_backend(f"writer-{suffix}", pool(12, seed=0), lambda *_: None, progress_thread=False)
    reader = open_nixl_backend(f"reader-{suffix}", pool(20, seed=1), notifications, progress_thread=False)
    try:
        peer = writer.add_peer(reader.metadata()).result(WAIT_S)
        reader.expect_notifications(1)
        yield writer, notifications, peer
    finally:
        writer.close()
        reader.close()


def test_a_write_waiting_for_another_post_counts_that_wait_as_time_before_posting(nixl_pair):
    """The NIXL backend posts one write at a time: a write asked for while another thread's post holds the backend
    waits, and that wait is reported apart from the time NIXL took."""
    writer, notifications, peer = nixl_pair
    with writer._lock:  # another thread's post, for 0.2 s
        asked = ThreadPoolExecutor(1).submit(writer.write, peer, [0, 1], [2, 3], b"req-1", timeout_s=WAIT_S)
        time.sleep(0.2)
    result = asked.result(WAIT_S).result(WAIT_S)
    assert notifications.next()[1] == b"req-1"
    assert 0.2 <= result.queued_seconds <= result.posting_seconds <= result.seconds


def test_a_posted_write_is_seen_complete_while_another_post_holds_the_backend(nixl_pair):
    """The transfer thread checks writes without the backend's lock (NIXL's agent serializes its own calls): a post
    holding the lock, even one waiting for the GIL meanwhile, does not delay seeing another write complete."""
    writer, notifications, peer = nixl_pair
    future = writer.write(peer, [0, 1], [2, 3], b"req-1", timeout_s=WAIT_S)
    with writer._lock:  # another thread's post, holding the backend for as long as this write takes
        assert future.result(WAIT_S).num_bytes > 0
    assert notifications.next()[1] == b"req-1"


def test_a_write_after_close_fails_at_once():
    writer = open_nixl_backend(f"writer-{uuid.uuid4().hex[:8]}", pool(12, seed=0), lambda *_: None,
                               progress_thread=False)
    writer.close()
    with pytest.raises(TransferError, match="closed"):
        writer.write("anyone", [0], [0], b"late", timeout_s=WAIT_S).result(WAIT_S)
