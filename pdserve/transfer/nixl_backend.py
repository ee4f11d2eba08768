"""A NIXL agent shared by the callers, who post their writes themselves, and a transfer thread of the backend's own,
which watches the writes complete and collects the notifications of writes into this pool, and reports both as events.

A write is posted in the thread that asks for it (the rank's event loop): handing it to the transfer thread instead
made it wait for that thread to wake and get the GIL from a step thread running Python, 1-2 ms a write under load
(docs/transfer.md). The two threads never wait on each other: NIXL's binding lets go of the GIL inside its calls and
its agent serializes them itself, so the transfer thread checks without any lock of ours; the backend's lock only
puts concurrent posts in a row and hands each posted write over. While writes are in flight the thread checks them
every 10 to 50 us (a write takes about a millisecond), and the notifications up to every 500 us while some are
awaited (for as long as a prefill computes); otherwise it sleeps on its command queue. Without NIXL's own progress
thread these checks are also what advances UCX (docs/transfer.md).
"""

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdserve.transfer.agent import KVTransferAgent, TransferHandle
from pdserve.transfer.backend import OnNotification, WriteResult
from pdserve.transfer.errors import TransferError, TransferTimeout

log = logging.getLogger(__name__)
MIN_PAUSE_S = 10e-6
MAX_PAUSE_WRITING_S = 50e-6  # its completion time is the transfer time the service measures
MAX_PAUSE_LISTENING_S = 500e-6
IDLE_WAIT_S = 0.05  # nothing in flight or awaited: notifications nobody waits for are drained this often
JOIN_TIMEOUT_S = 5.0


@dataclass(eq=False)
class _Write:
    handle: TransferHandle
    future: Future
    requested_s: float  # monotonic, when write() was called: the time a write takes includes its wait to be posted
    taken_s: float  # when the caller had the backend's lock (other threads' posts go first)
    deadline_s: float


class NixlBackend:
    def __init__(self, name: str, kv: torch.Tensor, on_notification: OnNotification, progress_thread: bool):
        self.name = name
        self._agent = KVTransferAgent(name, kv, progress_thread)
        self._metadata = self._agent.metadata()
        self._on_notification = on_notification
        self._lock = threading.Lock()  # one post at a time; a post and its hand-over to the thread against close()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._writes: list[_Write] = []  # posted, not complete: the transfer thread's own
        self._expected = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-transfer-{name}", daemon=True)
        self._thread.start()

    def metadata(self) -> bytes:
        return self._metadata

    def add_peer(self, blob: bytes) -> Future[str]:
        future: Future[str] = Future()

        def learn() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._agent.add_peer(blob))
                except Exception as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)

        self._commands.put(learn)
        return future

    def write(self, peer: str, src_page_ids: Sequence[int], dst_page_ids: Sequence[int], notif: bytes,
              timeout_s: float, layers: range | None = None) -> Future[WriteResult]:
        """Posts the write here and now (NIXL's post call returns at once; a page-major write is one byte range a run
        of pages); the transfer thread resolves the future when the write completes."""
        future: Future[WriteResult] = Future()
        requested_s = time.monotonic()
        with self._lock:
            taken_s = time.monotonic()
            if self._stop.is_set():
                future.set_exception(TransferError(f"transfer backend {self.name} closed"))
                return future
            try:
                handle = self._agent.write_pages(peer, list(src_page_ids), list(dst_page_ids), notif, layers)
            except Exception as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)
                return future
            write = _Write(handle, future, requested_s, taken_s, handle.started_s + timeout_s)
            self._commands.put(functools.partial(self._watch, write))  # wakes the thread, which watches it from now
        return future

    def expect_notifications(self, count: int) -> None:
        self._expected = count
        self._commands.put(_wake)

    def close(self) -> None:
        with self._lock:  # a write posted before this is handed over before the thread's last turn
            if self._stop.is_set():
                return
            self._stop.set()
        self._commands.put(_wake)
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # stuck in NIXL: closing the agent under it would be worse than leaking it
            log.error("transfer thread of %s did not stop within %s s; agent left open", self.name, JOIN_TIMEOUT_S)
            return
        self._agent.close()

    # --- the transfer thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        pause_s = MIN_PAUSE_S
        next_drain_s = 0.0
        while not self._stop.is_set():
            listening = bool(self._writes) or self._expected > 0
            progressed = self._run_commands(wait_s=0.0 if listening else IDLE_WAIT_S)
            # Each NIXL call costs this thread a wait for the GIL under load: notifications are asked for only while
            # some are awaited, and otherwise (a writer's pool) drained now and then.
            if self._expected > 0 or time.monotonic() >= next_drain_s:
                progressed |= self._deliver_notifications(self._agent.take_notifications())
                next_drain_s = time.monotonic() + IDLE_WAIT_S
            progressed |= self._resolve(self._finished_writes())
            if progressed or not listening:
                pause_s = MIN_PAUSE_S
            else:
                time.sleep(pause_s)
                pause_s = min(2 * pause_s, MAX_PAUSE_WRITING_S if self._writes else MAX_PAUSE_LISTENING_S)
        self._run_commands(wait_s=0.0)  # the writes handed over last
        unfinished, self._writes = self._writes, []
        for write in unfinished:
            self._agent.release(write.handle)
            write.future.set_exception(TransferError(f"transfer backend {self.name} closed"))

    def _watch(self, write: _Write) -> None:
        self._writes.append(write)  # looked up here, on the thread: `_finished_writes` replaces the list

    def _run_commands(self, wait_s: float) -> bool:
        try:
            command = self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            try:
                command()
            except Exception:  # noqa: BLE001 - the thread must outlive a bad command
                log.exception("transfer command failed on %s", self.name)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _deliver_notifications(self, notifications: list[tuple[str, bytes]]) -> bool:
        for writer, payload in notifications:
            try:
                self._on_notification(writer, payload)
            except Exception:  # noqa: BLE001 - one bad consumer call must not stop the others
                log.exception("notification handler failed on %s", self.name)
        return bool(notifications)

    def _finished_writes(self) -> list[tuple[_Write, str]]:
        """The writes done, failed or past their deadline (cancelled), each with its state, released and taken out
        of `_writes`."""
        finished = []
        for write in self._writes:
            state = self._agent.poll(write.handle)
            if state == "pending" and time.monotonic() < write.deadline_s:
                continue
            finished.append((write, state))
            self._agent.release(write.handle)  # cancels one still pending
        if finished:
            done = {id(write) for write, _ in finished}
            self._writes = [w for w in self._writes if id(w) not in done]
        return finished

    def _resolve(self, finished: list[tuple[_Write, str]]) -> bool:
        for write, state in finished:
            handle = write.handle
            if state == "done":
                seconds = time.monotonic() - write.requested_s
                posted_s = handle.posted_s or handle.started_s  # a notification-only write has no post call
                write.future.set_result(WriteResult(
                    handle.num_bytes, handle.num_descriptors, seconds, handle.started_s - write.requested_s,
                    queued_seconds=write.taken_s - write.requested_s, post_call_seconds=posted_s - handle.started_s))
            elif state == "error":
                write.future.set_exception(TransferError(f"write to {handle.peer!r} failed: {handle.error}"))
            else:
                write.future.set_exception(TransferTimeout(
                    f"write of {handle.num_bytes} bytes to {handle.peer!r} not done within its deadline"))
        return bool(finished)


def _wake() -> None:
    """A command that does nothing: it wakes the transfer thread from its wait on the queue."""
