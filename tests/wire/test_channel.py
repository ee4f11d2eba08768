"""The worker channel on real sockets on 127.0.0.1: WorkerClient against the worker's own channel server (behind a
minimal info endpoint that advertises its port), and raw connections that attack it as an outsider would."""

import asyncio
import socket
import struct
from collections.abc import AsyncGenerator, Awaitable, Callable

import msgspec
import pytest
from aiohttp import web

from pdserve.wire import channel as channel_module
from pdserve.wire.channel import Generate, GenerateRefused, Hello
from pdserve.wire.channel_server import ChannelServer
from pdserve.wire.client import WorkerClient, WorkerSession, WorkerUnavailable
from pdserve.wire.protocol import API_VERSION, GenerateRequest, RankInfo, TokenEvent, WorkerInfo

TOKEN = "channel-test-token"
TIMEOUT_S = 10.0  # bound on every wait below

Start = Callable[[GenerateRequest], Awaitable[AsyncGenerator[list[TokenEvent], None]]]


class StandIn:
    """The worker's channel server and an HTTP /internal/v1/info naming its port, in the test's loop. `events`
    makes a request's event batches; `closed` collects the ids of streams the server closed before their end."""

    def __init__(self, events: Callable[[GenerateRequest], AsyncGenerator[list[TokenEvent], None]]) -> None:
        self.events = events
        self.info_delay_s = 0.0  # how long its info takes to answer (a busy worker)
        self.started: list[str] = []
        self.closed: set[str] = set()
        self.channel = ChannelServer(TOKEN, self.start)

    async def start(self, request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        self.started.append(request.request_id)
        if request.request_id.startswith("refuse-"):
            raise GenerateRefused(int(request.request_id[7:]), "refused by the test")
        return self._watched(request)

    async def _watched(self, request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        ended = False
        try:
            async for batch in self.events(request):
                yield batch
            ended = True
        finally:
            if not ended:
                self.closed.add(request.request_id)

    async def __aenter__(self) -> "StandIn":
        self.channel_port = await self.channel.serve("127.0.0.1", 0)
        info = msgspec.json.encode(WorkerInfo(API_VERSION, "both", "m", 4096, [RankInfo(0, 16, 64, "a")],
                                              self.channel_port))
        async def answer_info(_: web.Request) -> web.Response:
            await asyncio.sleep(self.info_delay_s)
            return web.Response(body=info, content_type="application/json")

        app = web.Application()
        app.router.add_get("/internal/v1/info", answer_info)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *_) -> None:
        await self.channel.close()
        await self.runner.cleanup()


def run(scenario: Callable[[], Awaitable]):
    return asyncio.run(asyncio.wait_for(scenario(), 4 * TIMEOUT_S))


def request(request_id: str, prompt: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(request_id, 0, prompt or [1, 2, 3])


async def counted(request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
    """Five one-token events, the stream's number in each, a turn of the loop apart."""
    base = int(request.request_id.split("-")[1]) * 100
    for i in range(5):
        await asyncio.sleep(0)
        yield [TokenEvent(request.request_id, [base + i], finish_reason="length" if i == 4 else None)]


async def endless(request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
    while True:
        yield [TokenEvent(request.request_id, [7])]
        await asyncio.sleep(0.01)


async def one_then_silence(request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
    yield [TokenEvent(request.request_id, [7])]
    await asyncio.sleep(3600)


async def silence(request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
    await asyncio.sleep(3600)
    yield []


async def tokens_of(client: WorkerClient, generate: GenerateRequest, timeout_s: float = TIMEOUT_S) -> list[TokenEvent]:
    return [event async for event in client.generate(generate, timeout_s)]


async def wait_until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while not check():
            await asyncio.sleep(0.01)


def test_many_concurrent_streams_interleave_on_one_connection():
    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            client = WorkerClient(worker.url, session)
            streams = await asyncio.gather(*(tokens_of(client, request(f"s-{i}")) for i in range(1, 41)))
            return streams, len(worker.channel.connections)

    streams, connections = run(scenario)
    assert [[t for e in events for t in e.token_ids] for events in streams] == \
        [[100 * i + k for k in range(5)] for i in range(1, 41)]
    assert all(events[-1].finish_reason == "length" for events in streams)
    assert connections == 1


def test_a_prompt_of_128k_token_ids_fits_in_a_frame():
    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            return await tokens_of(WorkerClient(worker.url, session), request("s-1", list(range(131072))))

    assert run(scenario)[-1].finish_reason == "length"


def test_leaving_a_stream_early_cancels_it_on_the_worker_and_spares_the_others():
    async def scenario():
        async with StandIn(endless) as worker, WorkerSession(TOKEN) as session:
            client = WorkerClient(worker.url, session)
            left, kept = client.generate(request("left"), TIMEOUT_S), client.generate(request("kept"), TIMEOUT_S)
            await anext(left)
            await anext(kept)
            await left.aclose()  # the router's client went away
            await wait_until(lambda: "left" in worker.closed)
            still_streaming = [await anext(kept) for _ in range(3)]
            await kept.aclose()
            return worker.closed, still_streaming

    closed, still_streaming = run(scenario)
    assert "left" in closed and all(event.token_ids == [7] for event in still_streaming)


@pytest.mark.parametrize("status", [400, 403, 503])
def test_a_refusal_is_unavailable_refused_with_its_status(status: int):
    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            with pytest.raises(WorkerUnavailable) as refused:
                await tokens_of(WorkerClient(worker.url, session), request(f"refuse-{status}"))
            return refused.value

    error = run(scenario)
    assert error.refused and not error.timed_out and f"HTTP {status}" in str(error)


def test_a_broken_connection_fails_its_streams_and_the_next_generate_reconnects():
    async def scenario():
        async with StandIn(one_then_silence) as worker, WorkerSession(TOKEN) as session:
            client = WorkerClient(worker.url, session)
            streams = [client.generate(request(f"b-{i}"), TIMEOUT_S) for i in range(3)]
            firsts = [await anext(stream) for stream in streams]
            for connection in list(worker.channel.connections):
                connection.transport.abort()
            lasts = [await anext(stream) for stream in streams]
            worker.events = counted
            again = await tokens_of(client, request("s-9"))
            return firsts, lasts, again

    firsts, lasts, again = run(scenario)
    assert all(event.token_ids == [7] for event in firsts)
    assert all(e.finish_reason == "error" and "worker stream broke" in e.error for e in lasts)
    assert again[-1].finish_reason == "length"


def test_a_busy_worker_slower_than_the_quick_calls_timeout_still_gets_its_channel_opened():
    """The channel's port is asked for under the generate's connect timeout: a worker whose info takes longer than
    the quick calls' timeout (a busy CPU) is not unreachable (a decode worker's prefill link once failed so)."""
    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            worker.info_delay_s = 0.5
            return await tokens_of(WorkerClient(worker.url, session, request_timeout_s=0.1), request("s-1"))

    assert run(scenario)[-1].finish_reason == "length"


def test_a_worker_that_cannot_be_reached_is_unavailable_refused():
    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            await worker.channel.close()  # the info endpoint still answers; the channel's port does not
            with pytest.raises(WorkerUnavailable) as unreachable:
                await tokens_of(WorkerClient(worker.url, session), request("s-1"))
            return unreachable.value

    assert run(scenario).refused


def test_silence_before_the_first_event_times_out_unavailable_and_cancels_the_stream():
    async def scenario():
        async with StandIn(silence) as worker, WorkerSession(TOKEN) as session:
            with pytest.raises(WorkerUnavailable) as silent:
                await tokens_of(WorkerClient(worker.url, session), request("quiet"), timeout_s=0.2)
            await wait_until(lambda: "quiet" in worker.closed)
            return silent.value

    error = run(scenario)
    assert error.timed_out and not error.refused


def test_silence_between_events_ends_the_stream_with_an_error_and_cancels_it():
    async def scenario():
        async with StandIn(one_then_silence) as worker, WorkerSession(TOKEN) as session:
            events = await tokens_of(WorkerClient(worker.url, session), request("stalls"), timeout_s=0.2)
            await wait_until(lambda: "stalls" in worker.closed)
            return events

    events = run(scenario)
    assert events[0].token_ids == [7]
    assert events[-1].finish_reason == "error" and "worker stream broke" in events[-1].error


def test_a_retired_worker_keeps_its_channel_until_its_last_stream_ends():
    """A worker that left discovery (a pod being drained) finishes the streams it has; its channel closes after them."""
    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            client = WorkerClient(worker.url, session)
            in_flight = client.generate(request("s-1"), TIMEOUT_S)
            first = await anext(in_flight)
            client.retire_channel()
            rest = [event async for event in in_flight]
            await wait_until(lambda: not worker.channel.connections)
            again = await tokens_of(client, request("s-2"))  # back in the pool: a new channel
            client.retire_channel()  # nothing in flight: closed at once
            await wait_until(lambda: not worker.channel.connections)
            return [first, *rest], again

    streamed, again = run(scenario)
    assert [t for event in streamed for t in event.token_ids] == [100, 101, 102, 103, 104]
    assert streamed[-1].finish_reason == "length" and again[-1].finish_reason == "length"


def test_channels_probe_idle_workers_with_tcp_keepalive():
    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            await tokens_of(WorkerClient(worker.url, session), request("s-1"))
            channel = await session.channels.channel(worker.url, None, TIMEOUT_S)  # open: the port is not asked for
            return channel.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)

    assert run(scenario) == 1


def test_closing_the_session_closes_its_channels():
    async def scenario():
        async with StandIn(counted) as worker:
            session = WorkerSession(TOKEN)
            await tokens_of(WorkerClient(worker.url, session), request("s-1"))
            opened = len(worker.channel.connections)
            await session.close()
            await wait_until(lambda: not worker.channel.connections)
            return opened

    assert run(scenario) == 1


# --- an outsider's attacks: each connection is closed unserved, and an honest caller is served after them -------

def frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def hello(token: str) -> bytes:
    return frame(msgspec.msgpack.encode(Hello(token)))


def generate_frame(request_id: str) -> bytes:
    return frame(msgspec.msgpack.encode(Generate(1, request(request_id))))


ATTACKS = {
    "no hello": b"",
    "wrong token": hello("not-the-token") + generate_frame("attack"),
    "generate before hello": generate_frame("attack") + hello(TOKEN),
    "oversized length before hello": struct.pack("!I", channel_module.HELLO_MAX_FRAME_BYTES + 1) + b"x" * 64,
    "oversized length after hello": hello(TOKEN) + struct.pack("!I", 2**31) + b"x" * 64,
    "garbage": b"GET /internal/v1/generate HTTP/1.1\r\nhost: worker\r\n\r\n",
    "garbage frame after hello": hello(TOKEN) + frame(b"\xc1\xff\x00garbage"),
    "a message of the wrong shape after hello": hello(TOKEN) + frame(msgspec.msgpack.encode(["generate", 1, "x"])),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_is_closed_unserved_and_honest_callers_are_still_served(attack: str,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("pdserve.wire.channel_server.HELLO_TIMEOUT_S", 0.3)  # "no hello" waits this long

    async def scenario():
        async with StandIn(counted) as worker, WorkerSession(TOKEN) as session:
            reader, writer = await asyncio.open_connection("127.0.0.1", worker.channel_port)
            writer.write(ATTACKS[attack])
            async with asyncio.timeout(TIMEOUT_S):
                answer = await reader.read()  # until the worker closes the connection
            writer.close()
            honest = await tokens_of(WorkerClient(worker.url, session), request("s-1"))
            return answer, worker.started, honest

    answer, started, honest = run(scenario)
    assert answer == b"" and started == ["s-1"]  # nothing answered, nothing started but the honest caller's
    assert honest[-1].finish_reason == "length"
