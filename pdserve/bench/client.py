"""Replays a workload against an OpenAI-compatible router over streaming /v1/completions, timing every token.

Token counts come from the `return_token_ids` extension, so they are exact even when one SSE chunk carries several
tokens (such tokens share the chunk's arrival time, so their inter-token gaps are 0).

The HTTP client is aiohttp with msgspec: a chunk costs the client ~30 us of CPU against ~68 us with httpx's
pure-Python parser (200 paced streams on the 2-core build machine). At a P/D pair's top rates the client reads ~7k
chunks a second, and a busy client reads late, so the gaps it records would be its own.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pdserve.bench.workload import BenchRequest, WorkloadConfig
from pdserve.wire.protocol import token_gaps


@dataclass
class RequestResult:
    index: int
    ok: bool
    error: str = ""
    send_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive output tokens
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens as the router reports it


# The longest SSE line read whole (aiohttp's default buffer would fail a line of many tokens' logprobs).
READ_BUFFER_BYTES = 2**22


async def served_model(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/v1/models", raise_for_status=True) as response:
        return msgspec.json.decode(await response.read())["data"][0]["id"]


async def send_request(http: aiohttp.ClientSession, url: str, model: str, request: BenchRequest, run_start: float,
                       timeout_s: float) -> RequestResult:
    body = {
        "model": model, "prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
        "temperature": 0.0, "ignore_eos": True, "min_tokens": request.max_tokens, "return_token_ids": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    result = RequestResult(index=request.index, ok=False, send_s=sent - run_start)
    arrivals: list[tuple[float, int]] = []  # (when, tokens) per chunk that carried tokens
    try:
        await asyncio.wait_for(_stream(http, url, body, result, arrivals), timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:  # ValueError: msgspec, a line too long
        result.error = f"{type(error).__name__}: {error}"
        return result
    if result.error:
        return result
    result.e2e_s = time.perf_counter() - sent
    result.output_tokens = sum(tokens for _, tokens in arrivals)
    if arrivals:
        result.ttft_s = arrivals[0][0] - sent
        previous_s = None
        for now_s, tokens in arrivals:
            result.itl_s += token_gaps(previous_s, now_s, tokens)
            previous_s = now_s
    result.ok = result.output_tokens == request.max_tokens
    if not result.ok:
        result.error = f"expected {request.max_tokens} tokens, got {result.output_tokens}"
    return result


async def _stream(http: aiohttp.ClientSession, url: str, body: dict, result: RequestResult,
                  arrivals: list[tuple[float, int]]) -> None:
    async with http.post(url + "/v1/completions", data=msgspec.json.encode(body),
                         headers={"content-type": "application/json"}) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.read())[:300]!r}"
            return
        async for line in response.content:
            if not line.startswith(b"data: {"):  # blank separators and the closing [DONE]
                continue
            chunk = msgspec.json.decode(line[len(b"data: "):])
            now = time.perf_counter()
            tokens = sum(len(choice.get("token_ids") or []) for choice in chunk.get("choices", []))
            if tokens:
                arrivals.append((now, tokens))
            if chunk.get("usage"):
                usage = chunk["usage"]
                result.prompt_tokens = usage.get("prompt_tokens", 0)
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@dataclass(frozen=True)
class RunLimits:
    request_timeout_s: float = 300.0
    run_timeout_s: float = 3600.0  # the whole run; requests still out then are cancelled and count as failed


async def run_workload(url: str, requests: list[BenchRequest], cfg: WorkloadConfig, limits: RunLimits,
                       on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (or once a concurrency slot and its previous turn are free).
    Returns the results in request order and the run's duration in seconds."""
    slots = asyncio.Semaphore(cfg.max_concurrency or len(requests))
    finished = {request.index: asyncio.Event() for request in requests}
    results: dict[int, RequestResult] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limits.request_timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0), read_bufsize=READ_BUFFER_BYTES) as http:
        model = await served_model(http, url)
        run_start = time.perf_counter()

        async def one(request: BenchRequest) -> None:
            try:
                await asyncio.sleep(max(0.0, run_start + request.arrival_s - time.perf_counter()))
                if request.previous_turn is not None:
                    await finished[request.previous_turn].wait()
                async with slots:
                    results[request.index] = await send_request(http, url, model, request, run_start,
                                                                limits.request_timeout_s)
                if on_done is not None:
                    on_done(results[request.index])
            finally:
                finished[request.index].set()

        tasks = [asyncio.create_task(one(request)) for request in requests]
        _, pending = await asyncio.wait(tasks, timeout=limits.run_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration_s = time.perf_counter() - run_start
    ordered = [results.get(r.index) or RequestResult(index=r.index, ok=False, error="run timed out") for r in requests]
    return ordered, duration_s
