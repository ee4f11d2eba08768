"""Moves KV pages from this rank's pool into a peer rank's pool with one-sided NIXL WRITEs over UCX.

The writer (prefill rank) loads the reader's metadata blob and writes; the reader (decode rank) only
registers its pool, hands out `metadata()` and collects the notification each write delivers once all
its bytes have landed. The reader never needs the writer's metadata.

UCX transports: no UCX_* variable is needed. On one host without GPUs UCX puts over `cma`
(process_vm_writev) and sends notifications over `tcp` on loopback; between nodes it picks `rc`/`dc` on
InfiniBand/RoCE or `tcp`. Where `cma` is blocked (a container without CAP_SYS_PTRACE), UCX_TLS=tcp,self
works, about 3x slower here. UCX reads these variables itself; this module reads none.
Two threads may use one agent: NIXL's binding lets go of the GIL inside its calls, so its agent serializes them
itself (the STRICT sync mode), and each write's handle has a lock of its own, so that one thread's poll never meets
another's release of it (a peer's disconnect releases every write to it). Writes to one agent from several threads
must still be posted one at a time (`nixl_backend.NixlBackend` holds a lock for it).
"""

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixl_xfer_handle

from pdserve.transfer.errors import TransferError, TransferTimeout
from pdserve.transfer.layout import PoolLayout, check_page_ids, page_runs, run_descriptors
from pdserve.transfer.metadata import METADATA_VERSION, AgentMetadata, decode_metadata, encode_metadata

log = logging.getLogger(__name__)

TransferState = Literal["pending", "done", "error"]
T = TypeVar("T")


@dataclass(eq=False)
class TransferHandle:
    peer: str
    num_bytes: int
    num_descriptors: int
    xfer: nixl_xfer_handle | None  # None when nothing was posted (a notification-only write)
    state: TransferState = "pending"
    error: str = ""
    started_s: float = field(default_factory=time.monotonic)
    posted_s: float = 0.0  # monotonic, when NIXL's post call returned
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # held around its NIXL calls


@dataclass(frozen=True, slots=True)
class _Peer:
    name: str
    layout: PoolLayout


def _is_disconnect(exc: Exception) -> bool:
    # The binding's exception classes live in the CUDA-flavoured package nixl picked; match by name.
    return type(exc).__name__ == "nixlRemoteDisconnectError"


class KVTransferAgent:
    def __init__(self, name: str, kv: torch.Tensor, progress_thread: bool = True):
        """progress_thread: a NIXL thread that drives UCX in the background, so posted writes advance
        while the caller computes. It busy-polls one CPU core even when idle; without it, writes advance
        only inside poll/wait/take_notifications calls (see docs/transfer.md for the trade-off)."""
        self.name = name
        self.layout = PoolLayout.of_pool(kv)
        self._kv = kv  # keeps the registered memory alive as long as the agent
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._nixl = nixl_agent(name, config)
        if "UCX" not in self._nixl.backends:
            raise RuntimeError(f"NIXL agent {name!r}: UCX backend unavailable (plugins: {self._nixl.plugin_list})")
        self._registration = self._nixl.register_memory(kv.transpose(0, 1))  # the page-major tensor: contiguous
        self._peers: dict[str, _Peer] = {}
        # Held from a write's peer look-up to its handle being in `_in_flight`, and by remove_peer: a peer is not
        # dropped between a write's making and its cancelling (re-entrant: a disconnect while making drops it).
        self._peers_lock = threading.RLock()
        self._in_flight: set[TransferHandle] = set()
        self._closed = False

    def metadata(self) -> bytes:
        return encode_metadata(
            AgentMetadata(METADATA_VERSION, self.name, self._nixl.get_agent_metadata(), self.layout)
        )

    def add_peer(self, blob: bytes) -> str:
        """Learn a peer from its metadata blob; a name already known is not re-added (names are per start)."""
        metadata = decode_metadata(blob)
        if metadata.agent_name in self._peers:
            return metadata.agent_name
        theirs, ours = metadata.layout, self.layout
        if (theirs.num_layers, theirs.page_bytes) != (ours.num_layers, ours.page_bytes):
            raise ValueError(
                f"peer {metadata.agent_name!r} pool has {theirs.num_layers} layers of {theirs.page_bytes}-byte pages, "
                f"this pool {ours.num_layers} layers of {ours.page_bytes}-byte pages: not the same model"
            )
        loaded = self._nixl.add_remote_agent(metadata.nixl_metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != metadata.agent_name:
            raise ValueError(f"metadata blob names agent {metadata.agent_name!r} but NIXL loaded {loaded!r}")
        self._peers[loaded] = _Peer(loaded, theirs)
        return loaded

    def remove_peer(self, name: str) -> None:
        """Forget a peer (no-op if unknown). Its writes still in flight are cancelled first: NIXL must not
        drop a remote agent under an active transfer."""
        with self._peers_lock:
            known = self._peers.pop(name, None)
            handles = [h for h in list(self._in_flight) if h.peer == name]  # list(): one step, others discard
        for handle in handles:
            if handle.state == "pending":
                self._fail(handle, f"peer {name!r} was removed")
            self.release(handle)
        if known is not None:
            try:
                self._nixl.remove_remote_agent(name)
            except Exception as exc:  # NIXL already invalidates an agent that disconnected
                log.debug("remove_remote_agent(%s): %s", name, exc)

    def write_pages(
        self,
        peer: str,
        src_page_ids: Sequence[int],
        dst_page_ids: Sequence[int],
        notif: bytes,
        layers: range | None = None,
    ) -> TransferHandle:
        """Post one NIXL WRITE of `layers` (all by default) of each src page into the paired dst page of
        `peer`; `notif` reaches the peer after all the bytes. Returns at once; poll/wait the handle."""
        with self._peers_lock:
            handle = self._make_write(peer, src_page_ids, dst_page_ids, notif, layers)
            if handle.xfer is None:
                return handle
            self._in_flight.add(handle)
        with handle.lock:
            if handle.xfer is None:  # another thread dropped the peer meanwhile
                raise TransferError(f"write to peer {peer!r} cancelled before posting: {handle.error}")
            try:
                posted, error = self._nixl.transfer(handle.xfer), None
            except Exception as exc:
                posted, error = "ERR", exc
        if error is not None:
            self._on_error(handle, error)
            self.release(handle)
            raise TransferError(f"posting write to peer {peer!r} failed: {handle.error}") from error
        handle.posted_s = time.monotonic()
        if posted == "DONE":
            handle.state = "done"
        elif posted == "ERR":
            self._fail(handle, "NIXL refused to post the write")
        return handle

    def _make_write(self, peer: str, src_page_ids: Sequence[int], dst_page_ids: Sequence[int], notif: bytes,
                    layers: range | None) -> TransferHandle:
        """The write's NIXL request, not posted; a handle without one (done) where there is nothing to move."""
        target = self._peers.get(peer)
        if target is None:
            raise TransferError(f"peer {peer!r} is unknown to {self.name!r} (never added, removed, or disconnected)")
        layers = range(self.layout.num_layers) if layers is None else layers
        if layers.step != 1 or not (0 <= layers.start <= layers.stop <= self.layout.num_layers):
            raise ValueError(f"layers must be a step-1 range within [0, {self.layout.num_layers}], got {layers}")
        check_page_ids(src_page_ids, self.layout.num_pages, "src")
        check_page_ids(dst_page_ids, target.layout.num_pages, "dst")
        if len(set(dst_page_ids)) != len(dst_page_ids):
            raise ValueError(f"dst page ids must be distinct, got {list(dst_page_ids)}")
        runs = page_runs(src_page_ids, dst_page_ids)

        if not runs or not layers:
            # Nothing to move (every page already on the peer): the peer still waits for the notification.
            self._call_peer(peer, lambda: self._nixl.send_notif(peer, notif))
            return TransferHandle(peer, 0, 0, None, state="done")

        local = run_descriptors(self.layout, runs, layers, "src")
        remote = run_descriptors(target.layout, runs, layers, "dst")
        xfer = self._call_peer(
            peer,
            lambda: self._nixl.initialize_xfer(
                "WRITE",
                self._nixl.get_xfer_descs(local, self.layout.mem_type),
                self._nixl.get_xfer_descs(remote, target.layout.mem_type),
                peer,
                notif,
            ),
        )
        return TransferHandle(peer, int(local[:, 1].sum()), len(local), xfer)

    def poll(self, handle: TransferHandle) -> TransferState:
        with handle.lock:
            if handle.state != "pending" or handle.xfer is None:
                return handle.state
            try:
                status, error = self._nixl.check_xfer_state(handle.xfer), None
            except Exception as exc:
                status, error = "ERR", exc
        if error is not None:
            self._on_error(handle, error)  # may drop the peer, which releases this handle: outside its lock
            return handle.state
        if status == "DONE":
            handle.state = "done"
        elif status == "ERR":
            self._fail(handle, "NIXL reported the transfer as failed")
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        """Free the transfer; one still pending is cancelled. Safe to call twice."""
        self._in_flight.discard(handle)
        with handle.lock:
            xfer, handle.xfer = handle.xfer, None
            if xfer is None:
                return
            try:
                self._nixl.release_xfer_handle(xfer)
            except Exception as exc:  # NIXL could not cancel it; it keeps the handle and frees it at agent exit
                log.warning("releasing write to %s (%s): %s", handle.peer, handle.state, exc)

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until the write is done; raise TransferTimeout / TransferError otherwise. Always releases."""
        deadline = time.monotonic() + timeout_s
        pause_s = 1e-5
        try:
            while (state := self.poll(handle)) == "pending":
                if time.monotonic() >= deadline:
                    raise TransferTimeout(
                        f"write of {handle.num_bytes} bytes to peer {handle.peer!r} not done after {timeout_s:.3g} s"
                    )
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 1e-3)
            if state == "error":
                raise TransferError(f"write of {handle.num_bytes} bytes to peer {handle.peer!r} failed: {handle.error}")
        finally:
            self.release(handle)

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """(writer agent name, notif) of the writes that completed into this pool since the last call."""
        return [(peer, msg) for peer, msgs in self._nixl.get_new_notifs().items() for msg in msgs]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            self.remove_peer(peer)
        self._nixl.deregister_memory(self._registration)

    def __enter__(self) -> "KVTransferAgent":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call_peer(self, peer: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except Exception as exc:
            if _is_disconnect(exc):
                self.remove_peer(peer)  # so that a later add_peer loads it again
                raise TransferError(f"peer {peer!r} is disconnected (dead?); dropped it, re-add with fresh metadata") from exc
            raise TransferError(f"NIXL call towards peer {peer!r} failed: {type(exc).__name__}: {exc}") from exc

    def _on_error(self, handle: TransferHandle, exc: Exception) -> None:
        if _is_disconnect(exc):
            self._fail(handle, f"peer {handle.peer!r} disconnected (dead?); dropped it, re-add with fresh metadata")
            self.remove_peer(handle.peer)
        else:
            self._fail(handle, f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _fail(handle: TransferHandle, message: str) -> None:
        handle.state, handle.error = "error", message
