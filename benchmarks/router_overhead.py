"""What the router adds to a request: the router in front of a zero-latency stand-in worker, against the same load
sent straight to the stand-in ("direct"), in one run on one machine.

The stand-in (`stand-in` subcommand, started by `run` as its own process) is not a worker: it speaks the internal API
the router needs (health, info, load, KV events over HTTP; generate over the worker channel, served by the worker's own
channel module, answering every token at once as one TokenEvent, as a worker's edge writes the tokens a request has
queued, or paced, one event per token) and,
for the direct baseline, answers `/v1/completions` itself with the same tokens in OpenAI's shape. So direct costs
one HTTP exchange with no routing, and router - direct is the router's overhead.

    python benchmarks/router_overhead.py run [--requests 400] [--tokens 64] [--floor] [--repeat 5]
    python benchmarks/router_overhead.py run --token-interval-ms 20 --concurrency 256 --requests 1024

With --floor the non-streaming rows are also run through a bare proxy (`proxy` subcommand): uvicorn on the same loop
and parser in front, one pooled aiohttp session behind, the body forwarded to the stand-in's direct route and its
answer returned, nothing else. What it adds is the floor of any router on this stack; the router's own work is what it
adds beyond that.

Scenarios: non-streaming at concurrency 1 and 16, streaming 64-token responses at concurrency 32, every token in one
write (the router forwards what arrives together in one write); with --token-interval-ms, streams whose tokens come
one write each, that far apart, as from a decode step (tokens/s the router keeps up with, and the gaps clients see). The load
generator is aiohttp on asyncio in this process (httpx's own
client time, ~0.7 ms a request, would hide the router's); on a 2-core machine it shares the cores with the router and the
stand-in, as the issue's figures did.
"""

import argparse
import asyncio
import gc
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import aiohttp
import httpx
import msgspec

from pdserve.http.ports import free_port
from pdserve.http.internal_auth import TOKEN_ENV
from pdserve.wire.channel_server import ChannelServer
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

async def body_of(receive) -> bytes:
    """An ASGI request's whole body."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def stand_in_generate(token_interval_s: float):
    """The stand-in's generate for its channel: every token at once in one event, or one event per token, paced."""
    async def events(request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        n, prompt_tokens = request.sampling.max_tokens, len(request.prompt_token_ids)
        if not token_interval_s:
            yield [TokenEvent(request.request_id, [TOKEN_ID] * n, prompt_tokens=prompt_tokens, finish_reason="length")]
            return
        for i in range(n):
            await asyncio.sleep(token_interval_s)
            yield [TokenEvent(request.request_id, [TOKEN_ID], prompt_tokens=prompt_tokens,
                              finish_reason="length" if i == n - 1 else None)]

    async def start(request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        return events(request)

    return start


def stand_in_app(token: str, token_interval_s: float, channel_port: int):
    authorization = f"Bearer {token}".encode()
    health = msgspec.json.encode(WorkerHealth("ok", "both", 1))
    info = msgspec.json.encode(WorkerInfo(API_VERSION, "both", MODEL, 4096, [RankInfo(0, 16, 4096, "stand-in")],
                                          channel_port))
    load = msgspec.json.encode(LoadReport([RankLoad(0, 0, 0, 4096, 4096, 0)]))

    async def answer(send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})

    async def stream(send, parts: list[bytes], content_type: bytes) -> None:
        """All parts in one write, or with token_interval_s each part its own write that long after the last."""
        if not token_interval_s:
            return await answer(send, 200, b"".join(parts), content_type)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        for part in parts:
            await asyncio.sleep(token_interval_s)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

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
            usage = b"data: " + msgspec.json.encode({"id": "cmpl-direct", "object": "text_completion", "model": MODEL,
                                                     "choices": [], "usage": {"completion_tokens": n}}) + b"\n\n"
            return await stream(send, [chunk] * n + [usage + b"data: [DONE]\n\n"], b"text/event-stream")
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
        return await answer(send, 404, b"{}")

    return app


def serve_stand_in(port: int, token_interval_s: float) -> None:
    """The stand-in's HTTP app and its channel, in one event loop as in a worker."""
    import uvicorn
    token = os.environ[TOKEN_ENV]

    async def serve() -> None:
        channel = ChannelServer(token, stand_in_generate(token_interval_s))
        app = stand_in_app(token, token_interval_s, await channel.serve("127.0.0.1", 0))
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).serve()

    import uvloop
    uvloop.run(serve())  # the router's loop; uvicorn picks httptools where installed


def bare_proxy_app(target: str):
    """Forward each POST's body to the same path on `target` and return its answer whole: a router's floor."""
    session: aiohttp.ClientSession | None = None

    async def app(scope, receive, send) -> None:
        nonlocal session
        if scope["type"] != "http":
            return
        if session is None:  # opened in the loop that uses it
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with session.post(target + scope["path"], data=await body_of(receive),
                                headers={"content-type": "application/json"}) as response:
            body = await response.read()
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


def serve_bare_proxy(port: int, target: str) -> None:
    import uvicorn
    uvicorn.run(bare_proxy_app(target), host="127.0.0.1", port=port, log_level="warning", loop="auto", http="auto")


# --- the load -----------------------------------------------------------------------------------------------------

async def one(http: aiohttp.ClientSession, url: str, stream: bool, tokens: int, gaps: list[float]) -> tuple[float, int]:
    """One completion: its seconds and tokens; a stream adds the gaps between its chunks to `gaps`."""
    body = msgspec.json.encode({"model": MODEL, "prompt": "The capital of France is", "max_tokens": tokens,
                                "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True}})
    started = time.perf_counter()
    async with http.post(url + "/v1/completions", data=body, headers={"content-type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:300]!r}")
        if not stream:
            answer = msgspec.json.decode(await response.read())
            return time.perf_counter() - started, answer["usage"]["completion_tokens"]
        received, last_s = 0, None
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            if b'"usage"' in line:  # the last chunk: how many tokens the stream held (a chunk may hold several)
                received = msgspec.json.decode(line[6:])["usage"]["completion_tokens"]
                continue
            now = time.perf_counter()
            if last_s is not None:
                gaps.append(now - last_s)
            last_s = now
    return time.perf_counter() - started, received


async def load(url: str, concurrency: int, requests: int, stream: bool, tokens: int) -> dict:
    latencies: list[float] = []
    gaps: list[float] = []
    token_count = 0
    remaining = iter(range(2 * min(concurrency, 4)))  # first a few to open the connections
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        async def client() -> None:
            nonlocal token_count
            for _ in remaining:
                seconds, count = await one(http, url, stream, tokens, gaps)
                latencies.append(seconds)
                token_count += count
        await asyncio.gather(*(client() for _ in range(min(concurrency, 4))))  # warm the connections
        latencies.clear()
        gaps.clear()
        token_count = 0
        remaining = iter(range(requests))
        # The load generator's own collections would read as latency of what it measures: a full one walks the
        # torch objects this process imported for the tiny model (~60 ms, measured), and at concurrency 16 it set p99.
        gc.disable()
        try:
            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            wall = time.perf_counter() - started
        finally:
            gc.enable()
    latencies.sort()
    gaps.sort()
    return {"req_s": len(latencies) / wall, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))], "tok_s": token_count / wall,
            "gap_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else float("nan")}


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far (Linux /proc): what a row cost the router or proxy process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    processes = [subprocess.Popen([sys.executable, __file__, "stand-in", "--port", str(stand_in_port),
                                   "--token-interval-ms", str(args.token_interval_ms)], env=env)]
    try:
        wait_up(stand_in_url, "/health")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "pdserve", "router", "--model", str(model_dir), "--served-model-name", MODEL,
             "--workers", stand_in_url, "--host", "127.0.0.1", "--port", str(router_port)], env=env))
        wait_up(router_url, "/ready")
        router_pid, proxy_url, proxy_pid = processes[-1].pid, None, 0
        if args.floor:
            proxy_port = free_port()
            proxy_url = f"http://127.0.0.1:{proxy_port}"
            processes.append(subprocess.Popen([sys.executable, __file__, "proxy", "--port", str(proxy_port),
                                               "--target", stand_in_url]))
            proxy_pid = processes[-1].pid
            wait_up(proxy_url, "/health")
        if args.token_interval_ms:
            scenarios = [("streaming, paced", args.concurrency, True)]
            pace = f"each token its own write, {args.token_interval_ms} ms after the last"
        else:
            scenarios = [("non-streaming", 1, False), ("non-streaming", 16, False), ("streaming", 32, True)]
            pace = "all tokens in one write at once"
        rounds = f"; medians of {args.repeat} rounds, ratio's range in brackets" if args.repeat > 1 else ""
        print(f"{args.requests} requests per row, {args.tokens} tokens each; one stand-in worker, {pace}{rounds}")
        print("| scenario | concurrency | direct req/s | router req/s | ratio | direct p50 / p99 ms | router p50 / p99 ms "
              "| added p50 ms | direct tok/s | router tok/s | chunk gap p99 ms direct / router | front CPU us / request |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, concurrency, stream in scenarios:
            fronts = [(name, router_url, router_pid)]
            if proxy_url and not stream:
                fronts.append((f"{name}, bare proxy", proxy_url, proxy_pid))
            # Rounds of direct then each front: a ratio compares a front with the direct row just before it (the
            # machine's speed drifts between rounds), and a row reports each measure's median over the rounds.
            rounds: dict[str, list[tuple[dict, dict, float]]] = {row_name: [] for row_name, _, _ in fronts}
            for _ in range(args.repeat):
                direct = asyncio.run(load(stand_in_url, concurrency, args.requests, stream, args.tokens))
                for row_name, url, pid in fronts:
                    cpu_before_s = cpu_seconds(pid)
                    routed = asyncio.run(load(url, concurrency, args.requests, stream, args.tokens))
                    cpu_us = 1e6 * (cpu_seconds(pid) - cpu_before_s) / args.requests  # the warm-up's few included
                    rounds[row_name].append((direct, routed, cpu_us))
            for row_name, measured in rounds.items():
                print_row(row_name, concurrency, measured)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def print_row(name: str, concurrency: int, rounds: list[tuple[dict, dict, float]]) -> None:
    """One table row: each measure's median over the rounds; the ratio's range too where there were several."""
    def median(side: int, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    ratios = sorted(routed["req_s"] / direct["req_s"] for direct, routed, _ in rounds)
    ratio = f"{statistics.median(ratios):.2f}" + (f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else "")
    added_ms = statistics.median(routed["p50_ms"] - direct["p50_ms"] for direct, routed, _ in rounds)
    cpu_us = statistics.median(r[2] for r in rounds)
    print(f"| {name} | {concurrency} | {median(0, 'req_s'):,.0f} | {median(1, 'req_s'):,.0f} | {ratio} | "
          f"{median(0, 'p50_ms'):.2f} / {median(0, 'p99_ms'):.2f} | "
          f"{median(1, 'p50_ms'):.2f} / {median(1, 'p99_ms'):.2f} | {added_ms:.2f} | "
          f"{median(0, 'tok_s'):,.0f} | {median(1, 'tok_s'):,.0f} | "
          f"{median(0, 'gap_p99_ms'):.2f} / {median(1, 'gap_p99_ms'):.2f} | {cpu_us:,.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--requests", type=int, default=400)
    run_parser.add_argument("--tokens", type=int, default=64)
    run_parser.add_argument("--token-interval-ms", type=float, default=0.0,
                            help="> 0: the stand-in paces tokens this far apart, one write each (a decode step); "
                                 "one streaming row at --concurrency")
    run_parser.add_argument("--concurrency", type=int, default=256, help="streams at once, with --token-interval-ms")
    run_parser.add_argument("--floor", action="store_true", help="also through a bare proxy (non-streaming rows)")
    run_parser.add_argument("--repeat", type=int, default=1,
                            help="rounds of each row (direct, then each front); a row prints medians over them")
    stand_in_parser = commands.add_parser("stand-in", help="the stand-in worker (started by run)")
    stand_in_parser.add_argument("--port", type=int, required=True)
    stand_in_parser.add_argument("--token-interval-ms", type=float, default=0.0)
    proxy_parser = commands.add_parser("proxy", help="the bare proxy (started by run --floor)")
    proxy_parser.add_argument("--port", type=int, required=True)
    proxy_parser.add_argument("--target", required=True)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    elif args.command == "proxy":
        serve_bare_proxy(args.port, args.target)
    else:
        serve_stand_in(args.port, args.token_interval_ms / 1e3)


if __name__ == "__main__":
    main()
