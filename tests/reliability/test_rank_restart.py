"""One rank of a 2-rank (data-parallel, not expert-parallel) worker is SIGKILLed mid-stream: its stream ends with an
error event (no hang), the other rank keeps completing requests, the worker reports unhealthy while Ray restarts
the actor, then healthy again, and the restarted rank serves the same greedy tokens as before."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from load import rank_actor_pids_of
from probes import health_status, internal_token, wait_for

from pdserve.http.ports import free_port
from pdserve.wire.client import WorkerClient, WorkerSession
from pdserve.wire.protocol import GenerateRequest, TokenEvent
from pdserve.wire.sampling import SamplingParams

START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0
PROMPT = [5, 17, 42, 9, 100, 3]
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


async def generate(url: str, rank: int, sampling: SamplingParams, request_id: str) -> list[TokenEvent]:
    async with WorkerSession(internal_token()) as http:
        request = GenerateRequest(request_id, rank, PROMPT, sampling)
        stream = WorkerClient(url, http, 10.0).generate(request, REQUEST_TIMEOUT_S)
        return await asyncio.wait_for(_collect(stream), REQUEST_TIMEOUT_S)


async def _collect(stream) -> list[TokenEvent]:
    return [event async for event in stream]


def tokens(events: list[TokenEvent]) -> list[int]:
    return [t for event in events for t in event.token_ids]


@pytest.fixture
def two_rank_worker(tiny_v2, ray_address, tmp_path):
    port = free_port()
    log_path = tmp_path / "worker.log"
    command = [sys.executable, "-m", "pdserve", "worker", "--role", "both", "--ranks", "2", "--model", tiny_v2,
               "--ray-address", ray_address, "--dtype", "float32", "--num-pages", "64", "--host", "127.0.0.1",
               "--port", str(port)]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: health_status(url) == 200 or process.poll() is not None, START_TIMEOUT_S, "worker healthy")
        assert process.poll() is None, log_path.read_text()[-3000:]
        yield url, process
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the session this test started; its actors die with their job
        process.wait(timeout=10)


@pytest.mark.timeout(180)
def test_killing_one_rank_of_a_two_rank_worker_fails_its_stream_and_the_rank_comes_back(two_rank_worker):
    url, process = two_rank_worker
    before = {rank: tokens(asyncio.run(generate(url, rank, SHORT, f"before-{rank}"))) for rank in (0, 1)}
    pids = wait_for(lambda: len(p := rank_actor_pids_of(process.pid)) == 2 and p, 10.0, "two rank actors")

    async def poll_health(statuses: list[int | None]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not (503 in statuses and statuses[-1] == 200):
            statuses.append(await asyncio.to_thread(health_status, url))
            await asyncio.sleep(0.1)

    async def kill_one_mid_stream():
        streams = {rank: asyncio.create_task(generate(url, rank, LONG, f"long-{rank}")) for rank in (0, 1)}
        await asyncio.sleep(1.0)  # both ranks are decoding
        os.kill(pids[0], signal.SIGKILL)
        statuses: list[int | None] = []
        health = asyncio.create_task(poll_health(statuses))
        dead_rank = None
        for finished in asyncio.as_completed(streams.values(), timeout=REQUEST_TIMEOUT_S):
            events = await finished
            if events[-1].finish_reason == "error":
                dead_rank = int(events[-1].request_id.rsplit("-", 1)[1])
                break
        assert dead_rank is not None, "the killed rank's stream must end with an error event"
        # While the killed rank restarts, the other one keeps serving new requests.
        meanwhile = await generate(url, 1 - dead_rank, SHORT, "meanwhile")
        await health
        return dead_rank, {rank: await stream for rank, stream in streams.items()}, statuses, meanwhile

    dead_rank, streams, statuses, meanwhile = asyncio.run(kill_one_mid_stream())
    assert streams[dead_rank][-1].finish_reason == "error" and streams[dead_rank][-1].error
    assert streams[1 - dead_rank][-1].finish_reason == "length"
    assert len(tokens(streams[1 - dead_rank])) == LONG.max_tokens
    assert tokens(meanwhile) == before[1 - dead_rank]
    assert 503 in statuses and statuses[-1] == 200, "unhealthy while the rank restarts, then healthy"

    new_pids = wait_for(lambda: len(p := rank_actor_pids_of(process.pid)) == 2 and p, 30.0, "two rank actors")
    assert pids[0] not in new_pids and pids[1] in new_pids, "only the killed rank is a new process"
    after = {rank: tokens(asyncio.run(generate(url, rank, SHORT, f"after-{rank}"))) for rank in (0, 1)}
    assert after == before
