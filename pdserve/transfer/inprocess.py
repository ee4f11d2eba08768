"""The transfer backend for tests: the pools of several ranks in one process, a write a copy of the pages plus a
notification, on a thread of the writer's own, with injectable delay, failure and lost notifications."""

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdserve.transfer.backend import OnNotification, WriteResult
from pdserve.transfer.errors import TransferError, TransferTimeout
from pdserve.transfer.layout import PoolLayout, check_page_ids, page_runs, run_descriptors
from pdserve.transfer.metadata import METADATA_VERSION, AgentMetadata, decode_metadata, encode_metadata


@dataclass
class InjectedFaults:
    """Changed by a test between writes; read by each write as it runs."""

    write_delay_s: float = 0.0  # a slow wire: a write waits this long before its bytes move
    write_error: str | None = None  # every write fails with this message, nothing moved
    drop_notifications: bool = False  # the bytes land but the peer is never told


class InProcessFabric:
    """The backends of one process by agent name. A backend that leaves is a dead peer: writes to it fail."""

    def __init__(self) -> None:
        self._members: dict[str, "InProcessBackend"] = {}
        self._lock = threading.Lock()

    def join(self, backend: "InProcessBackend") -> None:
        with self._lock:
            self._members[backend.name] = backend

    def leave(self, name: str) -> None:
        with self._lock:
            self._members.pop(name, None)

    def member(self, name: str) -> "InProcessBackend | None":
        with self._lock:
            return self._members.get(name)


class InProcessBackend:
    def __init__(self, name: str, kv: torch.Tensor, on_notification: OnNotification, fabric: InProcessFabric,
                 faults: InjectedFaults | None = None):
        self.name = name
        self.kv = kv
        self.layout = PoolLayout.of_pool(kv)
        self.faults = faults or InjectedFaults()
        self._on_notification = on_notification
        self._fabric = fabric
        self._peers: set[str] = set()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-transfer-{name}")
        fabric.join(self)

    def metadata(self) -> bytes:
        return encode_metadata(AgentMetadata(METADATA_VERSION, self.name, b"", self.layout))

    def add_peer(self, blob: bytes) -> Future[str]:
        return self._thread.submit(self._add_peer, blob)

    def _add_peer(self, blob: bytes) -> str:
        metadata = decode_metadata(blob)
        theirs, ours = metadata.layout, self.layout
        if (theirs.num_layers, theirs.page_bytes) != (ours.num_layers, ours.page_bytes):
            raise ValueError(f"peer {metadata.agent_name!r} pool has another page shape: not the same model")
        if self._fabric.member(metadata.agent_name) is None:
            raise TransferError(f"peer {metadata.agent_name!r} is not reachable")
        self._peers.add(metadata.agent_name)
        return metadata.agent_name

    def write(self, peer: str, src_page_ids: Sequence[int], dst_page_ids: Sequence[int], notif: bytes,
              timeout_s: float, layers: range | None = None) -> Future[WriteResult]:
        return self._thread.submit(self._write, peer, list(src_page_ids), list(dst_page_ids), notif, timeout_s,
                                   layers, time.monotonic())

    def _write(self, peer_name: str, src: list[int], dst: list[int], notif: bytes, timeout_s: float,
               layers: range | None, posted_s: float) -> WriteResult:
        peer = self._fabric.member(peer_name)
        if peer_name not in self._peers or peer is None:
            self._peers.discard(peer_name)
            raise TransferError(f"peer {peer_name!r} is unknown to {self.name!r} (never added, or disconnected)")
        check_page_ids(src, self.layout.num_pages, "src")
        check_page_ids(dst, peer.layout.num_pages, "dst")
        layers = range(self.layout.num_layers) if layers is None else layers
        faults = self.faults
        if faults.write_delay_s >= timeout_s:
            time.sleep(timeout_s)
            raise TransferTimeout(f"write to {peer_name!r} not done within {timeout_s} s")
        time.sleep(faults.write_delay_s)
        if faults.write_error is not None:
            raise TransferError(f"write to {peer_name!r} failed: {faults.write_error}")
        if self._fabric.member(peer_name) is None:
            raise TransferError(f"peer {peer_name!r} disconnected (dead?)")
        if src:
            rows = torch.tensor(list(layers), dtype=torch.long)
            src_ids, dst_ids = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
            peer.kv[rows[:, None], dst_ids] = self.kv[rows[:, None], src_ids]
        if not faults.drop_notifications:
            peer._on_notification(self.name, notif)
        num_bytes = len(src) * len(layers) * self.layout.page_bytes
        descriptors = len(run_descriptors(self.layout, page_runs(src, dst), layers, "src"))
        return WriteResult(num_bytes, descriptors, time.monotonic() - posted_s)

    def expect_notifications(self, count: int) -> None:
        pass  # notifications are delivered by the writer's thread; nothing to listen for

    def close(self) -> None:
        self._fabric.leave(self.name)
        self._thread.shutdown(wait=False, cancel_futures=True)
