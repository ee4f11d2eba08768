"""KVTransferAgent between real processes: this test process writes, a spawned child process reads."""

import multiprocessing as mp
import time
import uuid
from multiprocessing.connection import Connection

import pytest
import torch

from pdserve.transfer.agent import KVTransferAgent
from pdserve.transfer.errors import TransferError

NUM_LAYERS, PAGE_SIZE, KV_DIM = 3, 4, 16
WRITER_PAGES, READER_PAGES = 12, 20
STEP_TIMEOUT_S = 10.0


def _pool(num_pages: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # page-major, seen layer-first, as an engine's pool (pdserve.ops.attention.new_kv_pool)
    return torch.randn(num_pages, NUM_LAYERS, PAGE_SIZE, KV_DIM, generator=generator).to(dtype).transpose(0, 1)


def _reader_main(
    conn: Connection, name: str, dtype: torch.dtype, seed: int, expected_notifs: int, progress_thread: bool
) -> None:
    """Child: register a pool, send its metadata, collect `expected_notifs` notifications, send back
    (notifications, final pool bytes); with expected_notifs=0 just stay alive until told or killed."""
    kv = _pool(READER_PAGES, dtype, seed)
    with KVTransferAgent(name, kv, progress_thread) as agent:
        conn.send(agent.metadata())
        notifs: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(notifs) < expected_notifs and time.monotonic() < deadline:
            notifs += agent.take_notifications()
            time.sleep(0.001)
        if expected_notifs:
            conn.send((notifs, kv.view(torch.uint8).numpy().tobytes()))
        conn.poll(60)


class _Reader:
    def __init__(self, dtype: torch.dtype, seed: int, expected_notifs: int, progress_thread: bool):
        self.name = f"reader-{uuid.uuid4().hex[:8]}"
        self.dtype, self.seed = dtype, seed
        self.conn, child_conn = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(
            target=_reader_main, args=(child_conn, self.name, dtype, seed, expected_notifs, progress_thread),
            daemon=True,
        )
        self.process.start()

    def receive(self):
        if not self.conn.poll(30):  # first message includes the child's torch + nixl import
            raise TimeoutError(f"reader {self.name} sent nothing within 30 s (exit code {self.process.exitcode})")
        return self.conn.recv()

    def result(self) -> tuple[list[tuple[str, bytes]], torch.Tensor]:
        notifs, pool_bytes = self.receive()
        shape = (NUM_LAYERS, READER_PAGES, PAGE_SIZE, KV_DIM)
        final = torch.frombuffer(bytearray(pool_bytes), dtype=torch.uint8).view(self.dtype).reshape(shape)
        return notifs, final

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)


@pytest.fixture
def spawn_reader():
    readers: list[_Reader] = []

    def spawn(dtype=torch.float32, seed=1, expected_notifs=1, progress_thread=True) -> _Reader:
        readers.append(_Reader(dtype, seed, expected_notifs, progress_thread))
        return readers[-1]

    yield spawn
    for reader in readers:
        reader.kill()


@pytest.fixture
def writer_pool() -> torch.Tensor:
    return _pool(WRITER_PAGES, torch.float32, seed=0)


def _writer(kv: torch.Tensor, progress_thread: bool = True) -> KVTransferAgent:
    return KVTransferAgent(f"writer-{uuid.uuid4().hex[:8]}", kv, progress_thread)


@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    "dtype, progress_thread",
    [(torch.float32, True), (torch.bfloat16, False)],
    ids=["float32-progress-thread", "bfloat16-no-progress-thread"],
)
def test_written_pages_land_exactly_and_untouched_pages_keep_their_bytes(spawn_reader, dtype, progress_thread):
    reader = spawn_reader(dtype, seed=1, expected_notifs=2, progress_thread=progress_thread)
    writer_kv = _pool(WRITER_PAGES, dtype, seed=0)
    src_ids = [0, 1, 2, 7, 5, 9, 10]  # runs 0-2 and 9-10, singles 7 and 5
    dst_ids = [3, 4, 5, 0, 17, 11, 12]
    with _writer(writer_kv, progress_thread) as writer:
        peer = writer.add_peer(reader.receive())
        assert peer == reader.name
        writer.wait(writer.write_pages(peer, src_ids, dst_ids, b"req-1"), timeout_s=STEP_TIMEOUT_S)
        writer.wait(writer.write_pages(peer, [11], [19], b"req-1/layer-1", layers=range(1, 2)), STEP_TIMEOUT_S)
        notifs, final = reader.result()

    assert sorted(notifs) == [(writer.name, b"req-1"), (writer.name, b"req-1/layer-1")]
    expected = _pool(READER_PAGES, dtype, seed=1)
    for src, dst in zip(src_ids, dst_ids):
        expected[:, dst] = writer_kv[:, src]
    expected[1, 19] = writer_kv[1, 11]
    for layer in range(NUM_LAYERS):
        assert torch.equal(final[layer].view(torch.uint8), expected[layer].view(torch.uint8)), f"layer {layer} differs"


@pytest.mark.timeout(60)
def test_a_restarted_peer_is_learned_under_its_new_name_and_written(spawn_reader, writer_pool):
    first = spawn_reader(seed=1)
    with _writer(writer_pool) as writer:
        first_name = writer.add_peer(first.receive())
        writer.wait(writer.write_pages(first_name, [3], [4], b"before"), STEP_TIMEOUT_S)
        assert first.result()[0] == [(writer.name, b"before")]
        first.kill()

        second = spawn_reader(seed=2)
        second_name = writer.add_peer(second.receive())
        assert second_name != first_name
        writer.wait(writer.write_pages(second_name, [3, 4], [6, 7], b"after"), STEP_TIMEOUT_S)
        notifs, final = second.result()

    assert notifs == [(writer.name, b"after")]
    assert torch.equal(final[:, 6:8], writer_pool[:, 3:5])


@pytest.mark.timeout(40)
def test_a_write_to_a_dead_peer_fails_within_the_timeout_and_drops_the_peer(spawn_reader, writer_pool):
    reader = spawn_reader(expected_notifs=0)
    with _writer(writer_pool) as writer:
        peer = writer.add_peer(reader.receive())
        reader.kill()
        started = time.monotonic()
        with pytest.raises(TransferError, match="disconnected|failed"):
            writer.wait(writer.write_pages(peer, [0, 1], [0, 1], b"lost"), timeout_s=5.0)
        assert time.monotonic() - started < 6.0
        with pytest.raises(TransferError, match="unknown"):
            writer.write_pages(peer, [0], [0], b"again")


def test_adding_a_known_peer_again_returns_the_cached_name(writer_pool):
    with _writer(writer_pool) as writer, _writer(_pool(READER_PAGES, torch.float32, seed=1)) as reader:
        blob = reader.metadata()
        assert writer.add_peer(blob) == reader.name
        assert writer.add_peer(blob) == reader.name


def test_a_peer_with_another_page_shape_is_refused(writer_pool):
    other_model = torch.zeros(READER_PAGES, NUM_LAYERS, PAGE_SIZE, KV_DIM * 2).transpose(0, 1)
    with _writer(writer_pool) as writer, _writer(other_model) as reader:
        with pytest.raises(ValueError, match="not the same model"):
            writer.add_peer(reader.metadata())


def test_writing_no_pages_still_notifies_the_peer(writer_pool):
    with _writer(writer_pool) as writer, _writer(_pool(READER_PAGES, torch.float32, seed=1)) as reader:
        peer = writer.add_peer(reader.metadata())
        handle = writer.write_pages(peer, [], [], b"all-cached")
        assert writer.poll(handle) == "done"
        deadline, notifs = time.monotonic() + STEP_TIMEOUT_S, []
        while not notifs and time.monotonic() < deadline:
            notifs = reader.take_notifications()
            time.sleep(0.001)
        assert notifs == [(writer.name, b"all-cached")]
