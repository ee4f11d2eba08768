"""Faults between real prefill and decode workers: the caller gets a clear error (never a hang), no page leaks,
and the survivors keep serving."""

import os
import signal
import threading
import time

import pytest
from probes import HTTP, internal_headers, metric_total
from worker_calls import TIMEOUT_S, disaggregated, generate, pages_at_rest, token_ids

from pdserve import SamplingParams
from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.wire.protocol import Plan

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
PROMPT = list(range(2, 60))


@pytest.fixture(scope="module")
def cluster(tiny_v2, ray_address, tmp_path_factory):
    """Shared by the tests below; each restarts what it kills."""
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "512", "--transfer-timeout-s", "10"),
                        log_dir=str(tmp_path_factory.mktemp("fault-cluster")))
    with LocalCluster(cfg) as local:
        yield local


def eventually(check, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def test_prefill_death_gives_an_error_frees_decode_pages_and_recovers(cluster):
    prefill, decode = cluster.workers
    expected = token_ids(disaggregated(decode.url, prefill.url, PROMPT, GREEDY))
    cluster.kill(prefill)
    started = time.monotonic()
    events = disaggregated(decode.url, prefill.url, PROMPT, GREEDY)
    assert events[-1].finish_reason == "error" and not token_ids(events)
    assert time.monotonic() - started < TIMEOUT_S
    assert eventually(lambda: pages_at_rest(decode.url))
    assert token_ids(generate(decode.url, PROMPT, GREEDY)) == expected  # the decode worker still serves
    cluster.restart(prefill)
    assert token_ids(disaggregated(decode.url, prefill.url, PROMPT, GREEDY)) == expected


def test_decode_death_mid_stream_ends_the_stream_and_frees_prefill_pages(cluster):
    prefill, decode = cluster.workers
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("events", disaggregated(decode.url, prefill.url,
                                                                                       PROMPT, LONG)))
    thread.start()
    time.sleep(3.0)  # well into decoding
    cluster.kill(decode)
    thread.join(timeout=TIMEOUT_S)
    assert not thread.is_alive()
    events = result["events"]
    assert events[-1].finish_reason == "error"
    assert 0 < len(token_ids(events)) < LONG.max_tokens
    assert eventually(lambda: pages_at_rest(prefill.url))
    cluster.restart(decode)
    assert disaggregated(decode.url, prefill.url, PROMPT, GREEDY)[-1].finish_reason == "length"


def test_abort_mid_stream_ends_with_abort_and_frees_pages(cluster):
    import httpx

    prefill, decode = cluster.workers
    result: dict = {}
    plan_thread = threading.Thread(target=lambda: result.setdefault(
        "events", generate(decode.url, PROMPT, LONG, Plan("both"), request_id="to-abort")))
    plan_thread.start()
    time.sleep(2.0)
    # what the router sends when its client disconnects
    assert HTTP.post(decode.url + "/internal/v1/abort", json={"request_id": "to-abort"}, headers=internal_headers(),
                      timeout=5).json()["aborted"]
    plan_thread.join(timeout=TIMEOUT_S)
    assert not plan_thread.is_alive()
    assert result["events"][-1].finish_reason == "abort"
    assert eventually(lambda: pages_at_rest(decode.url))


# slow: it starts a cluster of its own (~20 s alone, ~50 s in CI); the hand-off's timeout and late-write paths are
# also tested in process (tests/disagg/). `pytest -m slow` runs it.
@pytest.mark.slow
def test_a_stalled_prefill_times_out_and_its_late_request_is_refused_by_the_decode_worker(tiny_v2, ray_address,
                                                                                          tmp_path):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "512", "--prefill-timeout-s", "3",
                                     "--transfer-timeout-s", "2"),
                        log_dir=str(tmp_path))
    with LocalCluster(cfg) as cluster:
        prefill, decode = cluster.workers
        expected = token_ids(disaggregated(decode.url, prefill.url, PROMPT, GREEDY))
        written = metric_total(prefill.url, "pdserve_kv_transfer_bytes_total")
        os.kill(prefill.process.pid, signal.SIGSTOP)  # its HTTP server stops; the request waits in the socket
        try:
            started = time.monotonic()
            events = disaggregated(decode.url, prefill.url, PROMPT, GREEDY)
            assert events[-1].finish_reason == "error" and time.monotonic() - started < 30, events[-1]
            # never confirmed, so no write can target the reservation: it is freed at once, not quarantined
            assert eventually(lambda: pages_at_rest(decode.url), timeout_s=10)
        finally:
            os.kill(prefill.process.pid, signal.SIGCONT)  # the late request now reaches the prefill worker
        # its reservation query is refused by the decode worker: what it computed meanwhile is freed, nothing written
        assert eventually(lambda: metric_total(decode.url, "pdserve_kv_reservations_refused_total") >= 1, 30)
        assert eventually(lambda: pages_at_rest(prefill.url))
        assert metric_total(prefill.url, "pdserve_kv_transfer_bytes_total") == written
        for _ in range(3):  # the decode pool is intact: pages reused since give the same tokens
            events = disaggregated(decode.url, prefill.url, PROMPT, GREEDY)
            assert token_ids(events) == expected, events[-1]


def test_a_caller_that_hangs_up_mid_stream_stops_its_request_on_the_rank(cluster):
    """A rank's events reach the worker on one stream for all its requests (rank_actors.py): a caller that leaves
    its request's stream must still stop that request on the rank, not leave it decoding for no one."""
    import asyncio

    from probes import internal_token

    from pdserve.wire.client import WorkerClient, WorkerSession
    from pdserve.wire.protocol import GenerateRequest

    _, decode = cluster.workers

    async def read_some_then_leave() -> tuple[list, float]:
        request = GenerateRequest("hangs-up", 0, PROMPT, LONG, Plan("both"))
        async with WorkerSession(internal_token()) as http:
            events = WorkerClient(decode.url, http).generate(request, TIMEOUT_S)
            got = [await anext(events) for _ in range(20)]
            started = time.monotonic()
            got += [await anext(events) for _ in range(20)]
            per_event_s = (time.monotonic() - started) / 20
            await events.aclose()
        return got, per_event_s

    got, per_event_s = asyncio.run(asyncio.wait_for(read_some_then_leave(), TIMEOUT_S))
    assert all(event.finish_reason is None for event in got)
    left_s = (LONG.max_tokens - len(got)) * per_event_s  # how long the request would still run if not stopped
    assert eventually(lambda: pages_at_rest(decode.url), timeout_s=min(5.0, left_s / 2)), \
        f"the request still holds pages after its caller left (it had ~{left_s:.0f} s to run)"


def test_a_worker_refuses_a_plan_of_the_other_role_over_its_channel(cluster):
    """The channel answers a wrong plan as the HTTP route does: refused with 400 before anything runs (a router may
    then try elsewhere); the worker goes on serving."""
    from pdserve.wire.client import WorkerUnavailable

    prefill, decode = cluster.workers
    for url, plan in ((prefill.url, Plan("decode")), (decode.url, Plan("prefill"))):
        with pytest.raises(WorkerUnavailable) as refused:
            generate(url, PROMPT, GREEDY, plan)
        assert refused.value.refused and "HTTP 400" in str(refused.value) and "does not take" in str(refused.value)
    assert len(token_ids(disaggregated(decode.url, prefill.url, PROMPT, GREEDY))) == GREEDY.max_tokens
