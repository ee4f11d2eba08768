"""Slow clients against a live cluster, over raw sockets: a request head or body that trickles in (or stalls) gets
a 408 and its connection closed within the read bound; a client that stops reading a stream is cut after the send
bound and its request aborted on the worker; a client that closes while not reading frees its worker at once.
Meanwhile normal requests are served, nothing answers a 5xx, no process logs a traceback, and the cluster serves
normally afterwards. `pd_cluster` runs with 3 s bounds (tests/conftest.py); pdserve/http/slow_clients.py holds them."""

import concurrent.futures
import json
import re
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest
from probes import HTTP, eventually, internal_headers
from stream_calls import model_of, pages_at_rest, running

SLACK_S = 5.0  # on top of a bound: a 2-core box shared with other jobs
TRICKLE_INTERVAL_S = 0.5
NORMAL_TIMEOUT_S = 10.0
STALLED_CONNECTIONS = 200
LONG_STREAM_TOKENS = 4000  # many seconds of generation for the tiny model on CPU: still running when cut
BUFFER_FILL_S = 45.0  # a stream that is not read fills the router's send buffers first (LongStream)
CLIENT_KEEPALIVE_S = 5.0  # httpx's default expiry of an idle pooled connection


def flag(args: tuple[str, ...], name: str) -> float:
    return float(args[args.index(name) + 1])


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """What the server sends until it closes the connection; fails if it is still open after `limit_s`."""
    sock.settimeout(limit_s)
    deadline = time.monotonic() + limit_s
    received = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        except TimeoutError:
            break
        if not chunk:
            return received
        received += chunk
    pytest.fail(f"connection still open after {limit_s} s; received {received[:200]!r}")


def slow_request(url: str, first: bytes, rest: bytes = b"", limit_s: float = 30.0) -> tuple[float, bytes]:
    """Send `first`, then `rest` a byte every TRICKLE_INTERVAL_S (nothing more if empty); return the seconds from
    connecting until the server closed the connection, and what it answered."""
    sock = socket.create_connection(address(url), timeout=limit_s)
    stop = threading.Event()

    def trickle() -> None:
        for byte in rest:
            if stop.wait(TRICKLE_INTERVAL_S):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:  # the server closed the connection
                return

    started = time.monotonic()
    sock.sendall(first)
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        answer = read_until_closed(sock, limit_s)
        return time.monotonic() - started, answer
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()


def completion_body(model: str, max_tokens: int, stream: bool = False) -> bytes:
    return json.dumps({"model": model, "prompt": "a slow client, a fast router", "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": stream, "logprobs": 0,
                       "return_token_ids": True}).encode()


def post_head(path: str, content_length: int, extra_headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in (extra_headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {content_length}\r\n\r\n").encode()


def normal_completions(url: str, model: str, count: int = 3) -> list[float]:
    """Small non-streaming completions, one after another; each must succeed within NORMAL_TIMEOUT_S."""
    seconds = []
    for _ in range(count):
        started = time.monotonic()
        response = HTTP.post(url + "/v1/completions", content=completion_body(model, 8), timeout=NORMAL_TIMEOUT_S,
                              headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["token_ids"]) == 8
        seconds.append(time.monotonic() - started)
    return seconds


def while_slow_clients(url: str, model: str, *slow_calls) -> list[tuple[float, bytes]]:
    """Run the slow clients in threads while normal completions are served; return the slow clients' results."""
    with concurrent.futures.ThreadPoolExecutor(len(slow_calls)) as pool:
        futures = [pool.submit(call) for call in slow_calls]
        time.sleep(0.3)  # the slow clients are connected and stalling
        print(f"normal completions beside slow clients: {['%.2f s' % t for t in normal_completions(url, model)]}")
        results = [future.result(timeout=60) for future in futures]
    print(f"slow clients cut after: {['%.2f s' % seconds for seconds, _ in results]}")
    return results


def assert_timed_out(result: tuple[float, bytes], bound_s: float, answered_before: bytes = b"") -> None:
    """A 408 (after `answered_before`), and the connection closed at the bound, not before and not much after."""
    seconds, answer = result
    assert answer.startswith(answered_before) and b"HTTP/1.1 408 " in answer, answer[:300]
    assert answer.count(b"HTTP/1.1 ") == (2 if answered_before else 1), answer[:300]
    assert bound_s * 0.9 <= seconds <= bound_s + SLACK_S, (seconds, bound_s)


def client_disconnected_count(url: str) -> float:
    text = HTTP.get(url + "/metrics", timeout=10).text
    match = re.search(r'^pdserve_requests_total\{[^}]*status="client_disconnected"[^}]*\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


class LongStream:
    """A streamed completion from a client with a tiny receive buffer that reads nothing past the status line."""

    def __init__(self, url: str, model: str) -> None:
        self.sock = socket.socket()
        # Before connecting: a small receive window, and an Ethernet-sized segment as on a real network path.
        # Loopback's 64 KiB segments would make the router's kernel send buffer start at ~4 MB, enough to swallow
        # the whole stream; with 1460-byte segments it starts near 64 KiB, as it would for a remote client.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1460)
        self.sock.settimeout(30)
        self.sock.connect(address(url))
        body = completion_body(model, LONG_STREAM_TOKENS, stream=True)
        self.sock.sendall(post_head("/v1/completions", len(body)) + body)
        self.status_line = self.sock.recv(32)

    def read_rest(self, limit_s: float) -> bytes:
        return read_until_closed(self.sock, limit_s)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def model(pd_cluster) -> str:
    return model_of(pd_cluster.url)


@pytest.fixture
def cluster_stays_well(pd_cluster, model, caplog):
    """Around each test: every server still running, no traceback logged by any, pages at rest, normal service."""
    yield
    assert all(part.alive for part in [pd_cluster.router, *pd_cluster.workers])
    tracebacks = [r for r in caplog.get_records("call") if r.exc_info or "Exception in ASGI" in r.getMessage()]
    assert not tracebacks, "\n".join(caplog.text.splitlines()[-60:])
    assert all(eventually(lambda w=w: pages_at_rest(w.url), timeout_s=15) for w in pd_cluster.workers)
    normal_completions(pd_cluster.url, model, count=1)


def test_trickled_or_idle_request_head_gets_408_within_the_read_bound(pd_cluster, model, cluster_stays_well):
    bound_s = flag(pd_cluster.cfg.router_args, "--request-read-timeout-s")
    head = post_head("/v1/completions", 10)
    trickled = lambda: slow_request(pd_cluster.url, head[:5], head[5:] + b"{}")  # noqa: E731
    idle = lambda: slow_request(pd_cluster.url, b"")  # noqa: E731 - connects, sends nothing
    # One whole request on a kept-alive connection, then the next one's head trickles: its bound starts at its
    # first byte, one trickle interval after the first request.
    kept_alive = lambda: slow_request(pd_cluster.url, b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n", head)  # noqa: E731
    trickled_result, idle_result, kept_alive_result = while_slow_clients(pd_cluster.url, model, trickled, idle, kept_alive)
    assert_timed_out(trickled_result, bound_s)
    assert_timed_out(idle_result, bound_s)
    assert_timed_out(kept_alive_result, bound_s + TRICKLE_INTERVAL_S, answered_before=b"HTTP/1.1 200 ")


def test_trickled_or_stalled_body_gets_408_within_the_read_bound(pd_cluster, model, cluster_stays_well):
    bound_s = flag(pd_cluster.cfg.router_args, "--request-read-timeout-s")
    body = completion_body(model, 8)
    first = post_head("/v1/completions", len(body)) + body[:3]
    trickled = lambda: slow_request(pd_cluster.url, first, body[3:])  # noqa: E731
    stalled = lambda: slow_request(pd_cluster.url, first)  # noqa: E731
    for result in while_slow_clients(pd_cluster.url, model, trickled, stalled):
        assert_timed_out(result, bound_s)


def test_idle_kept_alive_connection_outlives_a_clients_expiry(pd_cluster, cluster_stays_well):
    """A server that closes an idle connection when its client would still reuse it (both at httpx's and uvicorn's
    5 s) makes that client's next request fail; router and worker keep one open for longer."""
    import http.client

    idle_s = CLIENT_KEEPALIVE_S + 1.0
    connections = [http.client.HTTPConnection(*address(url), timeout=10) for url in
                   (pd_cluster.url, pd_cluster.workers[0].url)]
    for connection in connections:
        connection.request("GET", "/health")
        connection.getresponse().read()
    sockets = [connection.sock for connection in connections]
    time.sleep(idle_s)
    for connection, sock in zip(connections, sockets, strict=True):
        connection.request("GET", "/health")  # on the same socket: http.client reconnects only once it is closed
        assert connection.sock is sock
        assert connection.getresponse().status == 200  # a closed connection raises RemoteDisconnected here
        connection.close()


def test_many_stalled_connections_hold_up_nothing_and_all_get_408(pd_cluster, model, cluster_stays_well):
    bound_s = flag(pd_cluster.cfg.router_args, "--request-read-timeout-s")
    body = completion_body(model, 8)
    partial_requests = [b"POST /v1/compl", post_head("/v1/completions", len(body)) + body[:3]]  # head, body stalls
    sockets = []
    try:
        started = time.monotonic()
        for i in range(STALLED_CONNECTIONS):
            sockets.append(socket.create_connection(address(pd_cluster.url), timeout=10))
            sockets[-1].sendall(partial_requests[i % 2])
        opened_s = time.monotonic() - started
        normal_completions(pd_cluster.url, model)
        answers = [read_until_closed(sock, bound_s + SLACK_S) for sock in sockets]
        all_closed_s = time.monotonic() - started
    finally:
        for sock in sockets:
            sock.close()
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers)
    assert all_closed_s <= opened_s + bound_s + SLACK_S, (opened_s, all_closed_s)


def test_worker_internal_api_bounds_slow_heads_and_bodies(pd_cluster, model, cluster_stays_well):
    worker = pd_cluster.workers[-1]  # the colocated one
    bound_s = flag(pd_cluster.cfg.worker_args, "--request-read-timeout-s")
    # With the credential: a caller without one is refused at once (tests/reliability/test_security.py).
    first = post_head("/internal/v1/generate", 500, internal_headers()) + b'{"request_id": "slow'
    trickled_body = lambda: slow_request(worker.url, first, b"x" * 100)  # noqa: E731
    stalled_head = lambda: slow_request(worker.url, b"GET /internal/v1/load HTTP/1.1\r\nho")  # noqa: E731
    for result in while_slow_clients(pd_cluster.url, model, trickled_body, stalled_head):
        assert_timed_out(result, bound_s)
    assert HTTP.get(worker.url + "/internal/v1/load", headers=internal_headers(), timeout=10).status_code == 200


def test_stream_reader_that_stops_then_closes_frees_its_worker(pd_cluster, model, cluster_stays_well):
    workers = [w.url for w in pd_cluster.workers]
    disconnected_before = client_disconnected_count(pd_cluster.url)
    stream = LongStream(pd_cluster.url, model)
    try:
        assert stream.status_line.startswith(b"HTTP/1.1 200"), stream.status_line
        assert eventually(lambda: sum(running(w) for w in workers) > 0, timeout_s=10)
        time.sleep(1.0)  # reading nothing, well inside the send bound
        assert sum(running(w) for w in workers) > 0  # the stream still generates: nothing cut it
    finally:
        stream.close()
    closed = time.monotonic()
    assert eventually(lambda: all(pages_at_rest(w) for w in workers), timeout_s=SLACK_S)
    print(f"closed -> worker at rest: {time.monotonic() - closed:.2f} s")
    assert eventually(lambda: client_disconnected_count(pd_cluster.url) == disconnected_before + 1, timeout_s=SLACK_S)


def test_stream_reader_that_never_reads_is_cut_after_the_send_bound(pd_cluster, model, cluster_stays_well):
    bound_s = flag(pd_cluster.cfg.router_args, "--send-stall-timeout-s")
    workers = [w.url for w in pd_cluster.workers]
    disconnected_before = client_disconnected_count(pd_cluster.url)
    stream = LongStream(pd_cluster.url, model)
    try:
        started = time.monotonic()
        assert stream.status_line.startswith(b"HTTP/1.1 200"), stream.status_line
        assert eventually(lambda: sum(running(w) for w in workers) > 0, timeout_s=10)
        normal_completions(pd_cluster.url, model)
        # Not reading, not closing: the router cuts the stream once its send buffer has stayed full for the bound,
        # and the worker's request is aborted with it, long before 4000 tokens are generated. Filling the buffers
        # first takes hundreds of tokens, seconds of the tiny model on a slow shared box (13 s was too few once in
        # CI); a stream that ran to its end instead would bring [DONE], checked below.
        assert eventually(lambda: all(pages_at_rest(w) for w in workers), timeout_s=bound_s + BUFFER_FILL_S)
        cut_s = time.monotonic() - started
        rest = stream.read_rest(limit_s=SLACK_S)  # what was buffered on the way, then the end of the connection
    finally:
        stream.close()
    print(f"stream start -> worker at rest: {cut_s:.2f} s; {rest.count(b'data: ')} events delivered")
    assert b"data: [DONE]" not in rest
    assert rest.count(b"data: ") < LONG_STREAM_TOKENS
    assert eventually(lambda: client_disconnected_count(pd_cluster.url) == disconnected_before + 1, timeout_s=SLACK_S)


def test_a_whole_response_caller_that_hangs_up_frees_its_worker(pd_cluster, model, cluster_stays_well):
    """A non-streaming completion whose client closes while it generates: the router notices within its look
    interval, aborts the request on the workers and counts it as client_disconnected."""
    workers = [w.url for w in pd_cluster.workers]
    disconnected_before = client_disconnected_count(pd_cluster.url)
    sock = socket.create_connection(address(pd_cluster.url), timeout=30)
    try:
        body = completion_body(model, LONG_STREAM_TOKENS)
        sock.sendall(post_head("/v1/completions", len(body)) + body)
        assert eventually(lambda: sum(running(w) for w in workers) > 0, timeout_s=10)
        time.sleep(0.7)  # past the router's first look: the client is still there, generation goes on
        assert sum(running(w) for w in workers) > 0
    finally:
        sock.close()
    assert eventually(lambda: all(pages_at_rest(w) for w in workers), timeout_s=SLACK_S)
    assert eventually(lambda: client_disconnected_count(pd_cluster.url) == disconnected_before + 1, timeout_s=SLACK_S)
