"""The router's hot POSTs through its own protocol (router/hot_routes.py: no ASGI layer, a whole response in one
write), over raw sockets against the in-process cluster (whose router serves with that protocol): pipelined requests
answered in order on one connection, a stream and an error among them, the connection kept alive after them, and
`Connection: close` and HTTP/1.0 honoured."""

import json
import socket
from urllib.parse import urlsplit

import pytest
from stream_calls import model_of

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def model(pd_cluster) -> str:
    return model_of(pd_cluster.url)


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S)


def post(body: dict | bytes, extra_headers: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (b"POST /v1/completions %s\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (version, len(data), extra_headers, data))


def completion(model: str, stream: bool = False) -> dict:
    return {"model": model, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stream": stream}


def read_response(reader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response off the connection: status, headers (lower-case names), body (de-chunked)."""
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, value = line.decode().split(":", 1)
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int(reader.readline().strip(), 16):
            body += reader.read(size)
            reader.readline()
        reader.readline()
    else:
        body = reader.read(int(headers["content-length"]))
    return status, headers, body


def assert_completion(response: tuple[int, dict[str, str], bytes]) -> None:
    status, headers, body = response
    assert status == 200, body
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["choices"][0]["finish_reason"] == "length"


def test_pipelined_hot_posts_are_answered_in_order_and_the_connection_kept(pd_cluster, model):
    with connect(pd_cluster.url) as sock:
        reader = sock.makefile("rb")
        sock.sendall(post(completion(model)) + post(completion(model, stream=True)) + post(b"{not json")
                     + post(completion(model)))
        assert_completion(read_response(reader))
        status, headers, body = read_response(reader)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert body.rstrip().endswith(b"data: [DONE]")
        status, headers, body = read_response(reader)
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
        assert_completion(read_response(reader))
        # still open: a later request on the same connection
        sock.sendall(post(completion(model)))
        assert_completion(read_response(reader))


@pytest.mark.parametrize("ending", ["connection-close", "http-1.0"])
def test_a_hot_post_that_asks_to_close_gets_its_answer_then_the_close(pd_cluster, model, ending):
    request = post(completion(model), b"connection: close\r\n") if ending == "connection-close" \
        else post(completion(model), version=b"HTTP/1.0")
    with connect(pd_cluster.url) as sock:
        reader = sock.makefile("rb")
        sock.sendall(request)
        response = read_response(reader)
        assert_completion(response)
        assert response[1]["connection"] == "close"
        assert reader.read() == b""  # the server closed it
