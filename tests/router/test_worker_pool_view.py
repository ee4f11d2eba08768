"""The pool's routing snapshot: ranks in URL order, kept when workers come and go, following a worker's new info
and its polled loads. Real WorkerPool and file discovery (tests/router/worker_pools.py)."""

from pdserve.discovery.endpoints import write_endpoints_file
from pdserve.wire.protocol import RankInfo, RankLoad, WorkerInfo
from tests.router.worker_pools import admit, pool_of


def test_ranks_come_in_url_order_and_follow_workers_that_come_go_and_change(tmp_path):
    workers_file = tmp_path / "workers"
    pool = pool_of(workers_file, ["http://c", "http://a"])
    admit(pool, "http://c", "prefill", 2)
    admit(pool, "http://a", "prefill", 1)
    assert pool.ranks_with_role(("prefill",)) == [("http://a", 0), ("http://c", 0), ("http://c", 1)]
    pool.report_failure("http://c")
    assert pool.ranks_with_role(("prefill",)) == [("http://a", 0)]
    admit(pool, "http://c", "prefill", 2)  # its next health check passes
    assert pool.ranks_with_role(("prefill",)) == [("http://a", 0), ("http://c", 0), ("http://c", 1)]

    write_endpoints_file(str(workers_file), ["http://c", "http://b"])  # a left, b joined
    pool._sync_endpoints()
    admit(pool, "http://b", "decode", 1)
    assert pool.ranks_with_role(("prefill",)) == [("http://c", 0), ("http://c", 1)]
    assert pool.ranks_with_role(("decode",)) == [("http://b", 0)]

    restarted = WorkerInfo(1, "prefill", "tiny", 4096, [RankInfo(r, 16, 64, f"c-{r}") for r in range(3)])
    pool.workers["http://c"].info = None  # ejected, then back with more ranks
    admit(pool, "http://c", "prefill", 3, info=restarted)
    assert pool.ranks_with_role(("prefill", "decode")) == [("http://b", 0)] + [("http://c", r) for r in range(3)]


def test_loads_follow_polls_and_assignments_and_survive_workers_coming(tmp_path):
    workers_file = tmp_path / "workers"
    pool = pool_of(workers_file, ["http://a", "http://b"])
    admit(pool, "http://a", "prefill", 2, [RankLoad(0, 1, 2, 30, 40, 0, queued_prompt_tokens=900,
                                                    prefill_tokens_per_s=3000.0), RankLoad(1, 0, 0, 40, 40, 0)])
    admit(pool, "http://b", "prefill", 1)
    candidates = pool.candidates(("prefill",))
    assert pool.loads_of(candidates).queue == [3, 0, 0]
    assert pool.loads_of(candidates).page_use == [0.25, 0.0, 0.0]
    assert pool.prefill_backlog(("http://a", 0)) == (900, 3000.0)
    pool.note_assignment(("http://a", 1), 100)
    pool.note_assignment(("http://a", 1), 50)
    pool.note_assignment(("http://a", 0), 0)  # the decode rank of a P/D pair: queued, nothing to prefill
    assert pool.loads_of(candidates).queue == [4, 2, 0]
    assert pool.prefill_backlog(("http://a", 0)) == (900, 3000.0)
    assert pool.prefill_backlog(("http://a", 1)) == (150, 0.0)  # not measured yet
    assert pool.loads_of(pool.candidates(("prefill",), {("http://a", 0)})).queue == [2, 0]
    assert pool.decode_backlog(("http://a", 1)) == (150, 0.0, 0)  # no chunk told, nothing measured

    write_endpoints_file(str(workers_file), ["http://a", "http://b", "http://0"])  # a new worker sorts first
    pool._sync_endpoints()
    admit(pool, "http://0", "prefill", 1, [RankLoad(0, 5, 0, 0, 40, 0)])
    admit(pool, "http://b", "prefill", 1, [RankLoad(0, 7, 1, 20, 40, 0)])  # polled again
    loads = pool.loads_of(pool.candidates(("prefill",)))
    # a's assignments since its poll are dropped when the table is rebuilt: its next poll counts them again
    assert loads.queue == [5, 3, 0, 8] and loads.page_use == [1.0, 0.25, 0.0, 0.5]


def test_a_decode_rank_reports_its_step_and_tells_its_chunk(tmp_path):
    pool = pool_of(tmp_path / "workers", ["http://d"])
    chunked = WorkerInfo(1, "decode", "tiny", 4096, [RankInfo(0, 16, 64, "d-0", prefill_chunk_tokens=512)])
    admit(pool, "http://d", "decode", 1, [RankLoad(0, 3, 0, 40, 40, 0, queued_prompt_tokens=64, decode_step_s=0.02)],
          info=chunked)
    assert pool.decode_backlog(("http://d", 0)) == (64, 0.02, 512)
    pool.note_assignment(("http://d", 0), 100)  # a prompt it will prefill itself
    assert pool.decode_backlog(("http://d", 0)) == (164, 0.02, 512)
    admit(pool, "http://d", "decode", 1, [RankLoad(0, 4, 0, 40, 40, 0, decode_step_s=0.03)])  # polled again
    assert pool.decode_backlog(("http://d", 0)) == (0, 0.03, 512)
    assert pool.decode_backlog(("http://elsewhere", 0)) == (0, 0.0, 0)
