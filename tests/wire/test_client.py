"""The sessions WorkerClient calls workers through (its generate streams: tests/wire/test_channel.py)."""

import asyncio

from pdserve.wire.client import LazyWorkerSession


def test_a_lazy_session_opens_on_first_use_closes_and_opens_anew_after():
    async def scenario() -> tuple[bool, bool, bool, bool]:
        lazy = LazyWorkerSession()
        await lazy.close()  # never opened: nothing to close
        first = lazy()
        same = lazy() is first
        await lazy.close()
        second = lazy()
        await lazy.close()
        return same, first.closed, second is not first, second.closed

    assert asyncio.run(scenario()) == (True, True, True, True)
