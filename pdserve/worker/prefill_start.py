"""A prefill plan at the worker edge: the rank takes the request at once and computes while the edge confirms the
plan's reservation with the decode worker (a round trip of ~3.6 ms, docs/benchmarks.md), and writes only once the
confirm is in. The edge answers the HTTP call after the confirm, so a refused plan still gets its 403 or 502."""

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from pdserve.disagg.guard import HandoffGuard
from pdserve.wire.protocol import GenerateRequest, Reservation

T = TypeVar("T")


async def start_prefill(guard: HandoffGuard, request: GenerateRequest,
                        generate: Callable[[GenerateRequest, Awaitable[Reservation]], AsyncGenerator[T, None]],
                        ) -> AsyncGenerator[T, None]:
    """The rank's stream (`generate`) of a prefill plan, once the decode worker confirmed the plan's reservation.
    Raises HandoffRefused: at once for a destination discovery does not name (the rank never sees the request), or
    after the confirm for a refused one (the rank's stream closed, which aborts its prefill and frees the pages)."""
    decode_url = guard.check_prefill_plan(request)
    confirm = asyncio.ensure_future(guard.confirm_reservation(request, decode_url))
    stream = generate(request, confirm)
    first = asyncio.ensure_future(anext(stream))  # the rank takes the request now
    try:
        await confirm
    except BaseException:
        first.cancel()
        await asyncio.wait({first})
        await stream.aclose()
        raise
    return _continued(first, stream)


async def _continued(first: asyncio.Future[T], stream: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """`stream`, whose first item `first` is already under way."""
    try:
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for item in stream:
            yield item
    finally:
        await stream.aclose()  # where the caller went away, the rank stops the request
