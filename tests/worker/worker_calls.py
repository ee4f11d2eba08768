"""Synchronous helpers for tests that talk to real workers over the internal API."""

import asyncio
import itertools

from probes import internal_token

from pdserve.wire.client import WorkerClient, WorkerSession
from pdserve.wire.protocol import GenerateRequest, LoadReport, Plan, PrefillSource, TokenEvent
from pdserve.wire.sampling import SamplingParams

_ids = itertools.count()
TIMEOUT_S = 120.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def _generate(url: str, request: GenerateRequest) -> list[TokenEvent]:
    async with WorkerSession(internal_token()) as http:
        return [event async for event in WorkerClient(url, http).generate(request, TIMEOUT_S)]


def generate(url: str, prompt: list[int], sampling: SamplingParams, plan: Plan | None = None,
             request_id: str | None = None) -> list[TokenEvent]:
    request = GenerateRequest(request_id or f"test-{next(_ids)}", 0, prompt, sampling, plan or Plan("both"))
    return run(_generate(url, request))


def disaggregated(decode_url: str, prefill_url: str, prompt: list[int], sampling: SamplingParams) -> list[TokenEvent]:
    return generate(decode_url, prompt, sampling, Plan("decode", prefill=PrefillSource(prefill_url, 0)))


def token_ids(events: list[TokenEvent]) -> list[int]:
    return [t for event in events for t in event.token_ids]


def load(url: str) -> LoadReport:
    async def fetch():
        async with WorkerSession(internal_token()) as http:
            return await WorkerClient(url, http, request_timeout_s=10.0).load()

    return run(fetch())


def pages_at_rest(url: str) -> bool:
    """Every page of every rank is free or held only by the prefix cache (no request holds any)."""
    return all(r.free_pages + r.prefix_cache_pages == r.total_pages and r.running == 0 and r.waiting == 0
               for r in load(url).ranks)
