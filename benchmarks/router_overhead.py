"""What the router adds to a request: the router in front of a zero-latency stand-in worker, against the same load
sent straight to the stand-in ("direct"), in one run on one machine.

The stand-in (`stand-in` subcommand, started by `run` as its own process) is not a worker: it speaks the internal API
the router needs (health, info, load, KV events, generate answering every token at once as NDJSON TokenEvents) and,
for the direct baseline, answers `/v1/completions` itself with the same tokens in OpenAI's shape. So direct costs
one HTTP exchange with no routing, and router - direct is the router's overhead.

    python benchmarks/router_overhead.py run [--requests 400] [--tokens 64]

Scenarios: non-streaming at concurrency 1 and 16, streaming 64-token responses at concurrency 32. The load
generator is httpx on asyncio in this process; on a 2-core machine it shares the cores with the router and the
stand-in, as the issue's figures did.
"""

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from pdserve.cluster.layout import free_port
from pdserve.http.internal_auth import TOKEN_ENV
from pdserve.wire.protocol import (
    API_VERSION,
    GenerateRequest,
    LoadReport,
    RankInfo,
    RankLoad,
    TokenEvent,
    WorkerHealth,
    WorkerInfo,
)

MODEL = "stand-in"
TOKEN_ID = 42  # every answered token; its text is whatever the tiny tokenizer makes of it


# --- the stand-in worker ----------------------------------------------------------------------------------------

def stand_in_app(token: str):
    authorization = f"Bearer {token}".encode()
    health = msgspec.json.encode(WorkerHealth("ok", "both", 1))
    info = msgspec.json.encode(WorkerInfo(API_VERSION, "both", MODEL, 4096, [RankInfo(0, 16, 4096, "stand-in")]))
    load = msgspec.json.encode(LoadReport([RankLoad(0, 0, 0, 4096, 4096, 0)]))
    decode_request = msgspec.json.Decoder(GenerateRequest).decode

    async def body_of(receive) -> bytes:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(chunks)

    async def answer(send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            return await answer(send, 200, health)
        if path == "/v1/completions":  # the direct baseline: OpenAI's shape, no routing
            request = msgspec.json.decode(await body_of(receive))
            n = request.get("max_tokens", 16)
            if not request.get("stream"):
                return await answer(send, 200, msgspec.json.encode({
                    "id": "cmpl-direct", "object": "text_completion", "model": MODEL,
                    "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}))
            chunk = b"data: " + msgspec.json.encode({"id": "cmpl-direct", "object": "text_completion", "model": MODEL,
                                                     "choices": [{"index": 0, "text": "x"}]}) + b"\n\n"
            return await answer(send, 200, chunk * n + b"data: [DONE]\n\n", b"text/event-stream")
        if dict(scope["headers"]).get(b"authorization") != authorization:
            return await answer(send, 401, b"{}")
        if path == "/internal/v1/info":
            return await answer(send, 200, info)
        if path == "/internal/v1/load":
            return await answer(send, 200, load)
        if path == "/internal/v1/kv_events":  # nothing is ever cached: an empty full dump, then a quiet stream
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})
            await send({"type": "http.response.body", "body": b'{"rank":0,"seq":0,"events":[]}\n', "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        if path == "/internal/v1/abort":
            return await answer(send, 200, b"{}")
        if path == "/internal/v1/generate":
            request = decode_request(await body_of(receive))
            n = request.sampling.max_tokens
            lines = [msgspec.json.encode(TokenEvent(request.request_id, [TOKEN_ID], prompt_tokens=len(
                request.prompt_token_ids), finish_reason="length" if i == n - 1 else None)) for i in range(n)]
            return await answer(send, 200, b"\n".join(lines) + b"\n", b"application/x-ndjson")
        return await answer(send, 404, b"{}")

    return app


def serve_stand_in(port: int) -> None:
    import uvicorn
    uvicorn.run(stand_in_app(os.environ[TOKEN_ENV]), host="127.0.0.1", port=port, log_level="warning",
                loop="auto", http="auto")  # uvloop and httptools where installed


# --- the load -----------------------------------------------------------------------------------------------------

async def one(http: httpx.AsyncClient, url: str, stream: bool, tokens: int) -> tuple[float, int]:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": tokens, "ignore_eos": True,
            "stream": stream}
    started = time.perf_counter()
    if not stream:
        response = await http.post(url + "/v1/completions", json=body)
        response.raise_for_status()
        return time.perf_counter() - started, response.json()["usage"]["completion_tokens"]
    received = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                received += 1
    return time.perf_counter() - started, received


async def load(url: str, concurrency: int, requests: int, stream: bool, tokens: int) -> dict:
    latencies: list[float] = []
    token_count = 0
    remaining = iter(range(2 * min(concurrency, 4)))  # first a few to open the connections
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        async def client() -> None:
            nonlocal token_count
            for _ in remaining:
                seconds, count = await one(http, url, stream, tokens)
                latencies.append(seconds)
                token_count += count
        await asyncio.gather(*(client() for _ in range(min(concurrency, 4))))  # warm the connections
        latencies.clear()
        token_count = 0
        remaining = iter(range(requests))
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {"req_s": len(latencies) / wall, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))], "tok_s": token_count / wall}


def wait_up(url: str, path: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}{path} not up within {timeout_s} s")


def run(args: argparse.Namespace) -> None:
    from pdserve.model.tiny import make_tiny_model

    env = {**os.environ, TOKEN_ENV: os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)}
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="router-overhead-")) / "model")
    stand_in_port, router_port = free_port(), free_port()
    stand_in_url, router_url = f"http://127.0.0.1:{stand_in_port}", f"http://127.0.0.1:{router_port}"
    processes = [subprocess.Popen([sys.executable, __file__, "stand-in", "--port", str(stand_in_port)], env=env)]
    try:
        wait_up(stand_in_url, "/health")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "pdserve", "router", "--model", str(model_dir), "--served-model-name", MODEL,
             "--workers", stand_in_url, "--host", "127.0.0.1", "--port", str(router_port)], env=env))
        wait_up(router_url, "/ready")
        scenarios = [("non-streaming", 1, False), ("non-streaming", 16, False), ("streaming", 32, True)]
        print(f"{args.requests} requests per row, {args.tokens} tokens each; one stand-in worker answering at once")
        print("| scenario | concurrency | direct req/s | router req/s | ratio | direct p50 / p99 ms | router p50 / p99 ms "
              "| added p50 ms | direct tok/s | router tok/s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, concurrency, stream in scenarios:
            direct = asyncio.run(load(stand_in_url, concurrency, args.requests, stream, args.tokens))
            routed = asyncio.run(load(router_url, concurrency, args.requests, stream, args.tokens))
            print(f"| {name} | {concurrency} | {direct['req_s']:,.0f} | {routed['req_s']:,.0f} | "
                  f"{routed['req_s'] / direct['req_s']:.2f} | {direct['p50_ms']:.2f} / {direct['p99_ms']:.2f} | "
                  f"{routed['p50_ms']:.2f} / {routed['p99_ms']:.2f} | {routed['p50_ms'] - direct['p50_ms']:.2f} | "
                  f"{direct['tok_s']:,.0f} | {routed['tok_s']:,.0f} |", flush=True)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--requests", type=int, default=400)
    run_parser.add_argument("--tokens", type=int, default=64)
    stand_in_parser = commands.add_parser("stand-in", help="the stand-in worker (started by run)")
    stand_in_parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        serve_stand_in(args.port)


if __name__ == "__main__":
    main()
