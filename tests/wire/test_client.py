"""The sessions WorkerClient calls workers through (its generate streams: tests/wire/test_channel.py)."""

import asyncio

from pdserve.wire.client import WorkerSession


def test_a_session_built_before_its_loop_opens_in_that_loop_on_first_use_and_closes():
    session = WorkerSession("token")  # no running loop yet, as where a worker builds its parts

    async def scenario() -> tuple[bool, bool, bool, bool]:
        first = session.http
        opened_here = first._loop is asyncio.get_running_loop()
        same = session.http is first
        await session.close()
        return opened_here, same, session.closed, first.closed

    assert asyncio.run(scenario()) == (True, True, True, True)


def test_closing_a_session_never_used_opens_nothing():
    session = WorkerSession()
    asyncio.run(session.close())
    assert session.closed and session._http is None
