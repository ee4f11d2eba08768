import asyncio

from pdserve.engine.config import EngineConfig
from pdserve.transfer.inprocess import InProcessBackend, InProcessFabric
from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import GenerateRequest
from pdserve.wire.sampling import SamplingParams
from pdserve.worker.kv_event_log import KVEventLog
from pdserve.worker.rank_config import RankConfig
from pdserve.worker.rank_runtime import RankRuntime


def stored_blocks():
    return [(0, 11), (11, 12)]


def test_subscriber_gets_only_newer_batches():
    log = KVEventLog(rank=3)
    for block in (1, 2, 3):
        log.record([KVEvent("stored", [block], 0)])
    batches = log.after(1, stored_blocks)
    assert [b.seq for b in batches] == [2, 3] and all(b.rank == 3 for b in batches)
    assert log.after(3, stored_blocks) == []


def test_new_too_old_or_future_subscriber_gets_a_full_dump():
    log = KVEventLog(rank=0, history=2)
    for block in (1, 2, 3):
        log.record([KVEvent("stored", [block], 0)])
    for seq in (-1, 0, 99):  # new subscriber, fell behind the history, or remembers a seq from before a restart
        (dump,) = log.after(seq, stored_blocks)
        assert dump.seq == 3
        assert dump.events[0].kind == "cleared"
        assert [(e.parent_hash, e.block_hashes) for e in dump.events[1:]] == [(0, [11]), (11, [12])]


def test_an_up_to_date_subscriber_waits_for_the_next_batch_and_gets_it_when_recorded(tiny_v2):
    """The rank answers a subscriber's long poll from its history, without a round trip to the step thread, and
    wakes it when the step thread records events (no polling interval in between)."""
    fabric = InProcessFabric()
    runtime = RankRuntime(
        RankConfig(rank=0, role="both", worker_url="http://worker.test", warmup=False,
                   engine=EngineConfig(tiny_v2, dtype="float32", num_pages=64, page_size=16, progress=False)),
        open_backend=lambda name, kv, on_notification: InProcessBackend(name, kv, on_notification, fabric))

    async def scenario() -> None:
        runtime.serve_here()
        await runtime.ready()
        (dump,) = await runtime.kv_events_after(-1)
        assert dump.events[0].kind == "cleared"
        waiting = asyncio.create_task(runtime.kv_events_after(dump.seq))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # nothing new: it waits rather than answering empty at once
        request = GenerateRequest("r1", 0, list(range(5, 45)), SamplingParams(max_tokens=1))
        async for _ in runtime.generate(request):
            pass
        batches = await asyncio.wait_for(waiting, 10)
        assert batches[0].seq == dump.seq + 1
        assert any(event.kind == "stored" for batch in batches for event in batch.events)
        assert await runtime.kv_events_after(batches[-1].seq) == []  # the long poll ran out: an empty answer

    try:
        asyncio.run(scenario())
    finally:
        runtime.stop()
