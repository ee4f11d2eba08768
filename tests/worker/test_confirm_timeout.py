"""A prefill worker's reservation query waits as long as the decode rank may wait for room (its prefill timeout) and
then some, no longer: under load the decode rank answers only once the pages are reserved, and a query cut at a
fixed few seconds failed requests the decode rank would have served."""

import asyncio
import time

import pytest
from probes import Listener

from pdserve.disagg.guard import HandoffRefused
from pdserve.engine.config import EngineConfig
from pdserve.wire.protocol import GenerateRequest, KVDestination, Plan
from pdserve.wire.sampling import SamplingParams
from pdserve.worker.config import WorkerConfig
from pdserve.worker.process import CONFIRM_MARGIN_S, handoff_guard


@pytest.fixture
def silent():
    made = Listener(hold=True)  # a decode worker's port that takes connections and never answers
    yield made
    made.close()


def test_the_reservation_query_waits_out_the_decode_ranks_prefill_timeout_then_gives_up(silent):
    cfg = WorkerConfig(EngineConfig(model="unused"), role="prefill", peers=(silent.url,), prefill_timeout_s=0.5,
                       internal_token="t" * 32)
    request = GenerateRequest("waits", 0, [5, 6, 7], SamplingParams(max_tokens=1),
                              Plan("prefill", destination=KVDestination(silent.url, 0, "token")))

    async def confirm() -> float:
        guard = handoff_guard(cfg)
        started = time.monotonic()
        try:
            with pytest.raises(HandoffRefused) as refused:
                await guard.confirm_reservation(request, guard.check_prefill_plan(request))
            assert refused.value.status == 502
            return time.monotonic() - started
        finally:
            await guard.close()

    waited_s = asyncio.run(asyncio.wait_for(confirm(), 30))
    bound_s = cfg.prefill_timeout_s + CONFIRM_MARGIN_S
    assert bound_s - 0.1 <= waited_s < bound_s + 1.0
