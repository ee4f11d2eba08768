"""Graceful drain of a worker process: the first SIGTERM (or SIGINT) stops admissions (/health says `draining`, new
generations get 503), in-flight generations run to their end for at most `drain_timeout_s`, then the server exits.
A second signal exits at once."""

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TypeVar

import uvicorn
from starlette.responses import StreamingResponse

log = logging.getLogger(__name__)
T = TypeVar("T")
# After the drain, connections that never end by themselves (KV-event subscriptions) are cut after this long.
SHUTDOWN_AFTER_DRAIN_S = 2


class DrainGate:
    """Counts the generations in flight and knows whether the worker is draining."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.in_flight = 0
        self.draining_since_s: float | None = None
        self._clock = clock

    @property
    def draining(self) -> bool:
        return self.draining_since_s is not None

    def start_draining(self) -> None:
        if self.draining_since_s is None:
            self.draining_since_s = self._clock()

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """In flight for the block: a generation before its response exists (a prefill plan being confirmed)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def counting(self, stream: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """`stream`, in flight from its first read until it ends or is closed."""
        with self.counted():
            async with contextlib.aclosing(stream):
                async for item in stream:
                    yield item

    def drained(self, timeout_s: float) -> bool:
        """Draining and either nothing is in flight or the grace period is over."""
        if self.draining_since_s is None:
            return False
        return self.in_flight == 0 or self._clock() - self.draining_since_s >= timeout_s


class CountedStreamingResponse(StreamingResponse):
    """A generation's stream, counted in flight from creation to its last byte (or the client leaving)."""

    def __init__(self, content, gate: DrainGate, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._gate = gate
        gate.in_flight += 1

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gate.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first exit signal drains instead of closing the listener at once: the router must still be
    able to read `draining` from /health, and in-flight streams keep their connections."""

    def __init__(self, config: uvicorn.Config, gate: DrainGate, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._gate = gate
        self._drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig, frame) -> None:
        if self._gate.draining:
            self.should_exit = self.force_exit = True
            return
        log.warning("signal %s: draining (%d in flight, up to %.0f s)", sig, self._gate.in_flight, self._drain_timeout_s)
        print(f"pdserve worker: draining, {self._gate.in_flight} request(s) in flight", flush=True)
        self._gate.start_draining()

    async def on_tick(self, counter: int) -> bool:
        if self._gate.drained(self._drain_timeout_s):
            if self._gate.in_flight:
                log.warning("drain timeout: %d request(s) still in flight are cut", self._gate.in_flight)
            return True
        return await super().on_tick(counter)
