from pdserve.wire.kv_events import KVEvent
from pdserve.worker.kv_event_log import KVEventLog


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
