"""A prefill rank and a decode rank in this process, wired as two workers are: real engines (tiny model), the
in-process transfer backend between their pools, and the worker edge's guard in front of the prefill rank. Only the
HTTP hop is left out; a test can make that hop refuse, hang, or die after the confirm."""

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from pdserve.discovery.endpoints import StaticDiscovery
from pdserve.disagg.guard import HandoffGuard, HandoffRefused
from pdserve.engine.config import EngineConfig
from pdserve.transfer.inprocess import InjectedFaults, InProcessBackend, InProcessFabric
from pdserve.wire.client import WorkerUnavailable
from pdserve.wire.protocol import GenerateRequest, Plan, PrefillSource, ReservationQuery, TokenEvent
from pdserve.wire.sampling import SamplingParams
from pdserve.worker.prefill_start import start_prefill
from pdserve.worker.rank_config import RankConfig
from pdserve.worker.rank_runtime import RankRuntime

T = TypeVar("T")
PREFILL_URL, DECODE_URL = "http://prefill.test:8100", "http://decode.test:8100"
CALL_TIMEOUT_S = 30.0


class PrefillWorker:
    """The prefill worker as the decode rank reaches it: what its HTTP edge does (the rank computing while the guard
    confirms the reservation), in process.
    `mode`: normal; refuse (nothing listens); hang (takes the request, never answers); die_after_confirm."""

    def __init__(self, guard: HandoffGuard, runtime: RankRuntime):
        self.guard, self.runtime = guard, runtime
        self.mode = "normal"
        self.drop_aborts = False  # the decode rank's abort never arrives, nor does its closing the stream
        self._detached: set[asyncio.Task] = set()

    async def generate(self, request: GenerateRequest, first_token_timeout_s: float) -> AsyncIterator[TokenEvent]:
        if self.mode == "refuse":
            raise WorkerUnavailable("connection refused", refused=True)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        try:
            if self.mode == "die_after_confirm":  # the confirm alone: the process is gone before its rank writes
                await self.guard.confirm_reservation(request, self.guard.check_prefill_plan(request))
            else:
                stream = await start_prefill(self.guard, request, self.runtime.generate)
        except HandoffRefused as refused:
            raise WorkerUnavailable(f"HTTP {refused.status}: {refused}", refused=True) from refused
        if self.mode == "die_after_confirm":  # its stream breaks, nothing is written
            yield TokenEvent(request.request_id, [], finish_reason="error", error="worker stream broke")
            return
        if not self.drop_aborts:
            async for event in stream:
                yield event
            return
        # Nothing the decode rank does reaches the prefill rank now, not even closing the stream.
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._detached.add(asyncio.ensure_future(self._feed(stream, events)))
        while (event := await events.get()).finish_reason is None:
            yield event
        yield event

    async def _feed(self, stream: AsyncIterator[TokenEvent], events: asyncio.Queue) -> None:
        async for event in stream:
            events.put_nowait(event)

    async def abort(self, request_id: str) -> None:
        if not self.drop_aborts:  # an abort the decode rank sends
            await self.runtime.abort(request_id)


class Pair:
    def __init__(self, model_dir: str, prefill_timeout_s: float = 1.5, transfer_timeout_s: float = 0.5):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pair-loop", daemon=True)
        self._thread.start()
        self.fabric = InProcessFabric()
        self.prefill_faults, self.decode_faults = InjectedFaults(), InjectedFaults()
        engine = EngineConfig(model=model_dir, dtype="float32", num_pages=64, progress=False)

        def config(role: str, url: str) -> RankConfig:
            return RankConfig(0, role, engine, url, transfer_timeout_s, prefill_timeout_s, warmup=False,  # type: ignore[arg-type]
                              clock_margin_s=0.05)

        def backend(faults: InjectedFaults):
            return lambda name, kv, on_notification: InProcessBackend(name, kv, on_notification, self.fabric, faults)

        self.prefill = RankRuntime(config("prefill", PREFILL_URL), backend(self.prefill_faults))
        self.prefill_worker = PrefillWorker(HandoffGuard(StaticDiscovery([DECODE_URL]), self._confirm_at),
                                            self.prefill)
        self.decode = RankRuntime(config("decode", DECODE_URL), backend(self.decode_faults),
                                  prefill_link=lambda source: self.prefill_worker)
        for runtime in (self.prefill, self.decode):
            runtime.start(self.loop)
            self.run(runtime.ready())

    async def _confirm_at(self, url: str, query: ReservationQuery):
        assert url == DECODE_URL
        return await self.decode.confirm_reservation(query)

    def run(self, work: Coroutine[Any, Any, T], timeout_s: float = CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    def generate(self, runtime: RankRuntime, request: GenerateRequest) -> list[TokenEvent]:
        return self.run(collect(runtime, request))

    def disaggregated(self, request_id: str, prompt: list[int], sampling) -> list[TokenEvent]:
        return self.start_disaggregated(request_id, prompt, sampling).result(CALL_TIMEOUT_S)

    def start_disaggregated(self, request_id: str, prompt: list[int], sampling) -> concurrent.futures.Future:
        """A decode-plan request on the decode rank, running in the background: result() gives its events."""
        return asyncio.run_coroutine_threadsafe(collect(self.decode, decode_plan(request_id, prompt, sampling)),
                                                self.loop)

    def reset(self) -> None:
        self.prefill_worker.mode, self.prefill_worker.drop_aborts = "normal", False
        for faults in (self.prefill_faults, self.decode_faults):
            faults.write_delay_s, faults.write_error, faults.drop_notifications = 0.0, None, False
        self.prefill.steps.test_step_delay_s = self.decode.steps.test_step_delay_s = 0.0

    def close(self) -> None:
        for runtime in (self.prefill, self.decode):
            runtime.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def collect(runtime: RankRuntime, request: GenerateRequest) -> list[TokenEvent]:
    return [event async for event in runtime.generate(request)]


def decode_plan(request_id: str, prompt: list[int], sampling: SamplingParams) -> GenerateRequest:
    return GenerateRequest(request_id, 0, prompt, sampling, Plan("decode", prefill=PrefillSource(PREFILL_URL, 0)))


def at_rest(runtime: RankRuntime) -> bool:
    """No request holds a page (the prefix cache may), and no hand-off is under way."""
    load = runtime.load()
    return (load.free_pages + load.prefix_cache_pages == load.total_pages and load.running == 0
            and load.waiting == 0 and not runtime.engine.requests)
