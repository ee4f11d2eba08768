"""The step trace: a step's shape as the engine scheduled it, and one line per busy step of a rank's step loop with
the turn it took (to the next step's start, never an idle wait), written by a real engine on the tiny model, alone
and inside a worker started with `--step-trace`; the time collecting garbage in each turn."""

import asyncio
import gc
import itertools
import time
from pathlib import Path

import pytest
from probes import HTTP, eventually

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine, RequestOutput
from pdserve.engine.step_shape import StepShape
from pdserve.engine.step_trace import StepTrace, rank_trace_path, read_trace
from pdserve.wire.sampling import SamplingParams
from pdserve.worker.gc_pauses import GcClock
from pdserve.worker.step_loop import StepLoop

TIMEOUT_S = 60.0
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_the_engine_reports_each_steps_decodes_and_prefill_chunks(tiny_v2):
    engine = Engine(EngineConfig(model=tiny_v2, dtype="float32", num_pages=64, page_size=16,
                                 max_num_batched_tokens=32, progress=False))
    engine.add_request("a", list(range(5, 25)), GREEDY)  # 20 tokens
    engine.add_request("b", list(range(5, 35)), GREEDY)  # 30 tokens
    shapes = []
    while engine.has_work():
        engine.step()
        shapes.append(engine.last_step)
    assert shapes == [
        StepShape(prefill_tokens=32, prefill_seqs=2),  # a whole, and 12 of b under the 32-token budget
        StepShape(decode_batch=1, decode_context=21, prefill_tokens=18, prefill_seqs=1),  # a decodes beside b's rest
        StepShape(decode_batch=2, decode_context=(22 + 31) / 2),
        StepShape(decode_batch=2, decode_context=(23 + 32) / 2),
        StepShape(decode_batch=1, decode_context=33),  # a made its 4 tokens a step earlier
    ]



def test_a_step_beside_decodes_carries_at_most_mixed_prefill_tokens_of_prefill(tiny_v2):
    engine = Engine(EngineConfig(model=tiny_v2, dtype="float32", num_pages=64, page_size=16,
                                 max_num_batched_tokens=32, mixed_prefill_tokens=8, progress=False))
    engine.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.last_step == StepShape(prefill_tokens=20, prefill_seqs=1)  # no decodes yet: the whole budget
    engine.add_request("b", list(range(5, 35)), GREEDY)  # 30 tokens
    engine.add_request("c", list(range(5, 15)), GREEDY)  # 10 tokens, waits for b's chunks
    shapes = []
    for _ in range(6):
        engine.step()
        shapes.append(engine.last_step)
    assert shapes == [
        StepShape(decode_batch=1, decode_context=21, prefill_tokens=8, prefill_seqs=1),
        StepShape(decode_batch=1, decode_context=22, prefill_tokens=8, prefill_seqs=1),
        StepShape(decode_batch=1, decode_context=23, prefill_tokens=8, prefill_seqs=1),
        StepShape(decode_batch=1, decode_context=24, prefill_tokens=8, prefill_seqs=2),  # b's last 6, 2 of c
        StepShape(decode_batch=2, decode_context=(25 + 31) / 2, prefill_tokens=8, prefill_seqs=1),  # c's rest
        StepShape(decode_batch=3, decode_context=(26 + 32 + 11) / 3),
    ]

class TracedLoop:
    def __init__(self, model: str, trace_path: Path):
        self.finished: list[str] = []
        self.steps = StepLoop(Engine(EngineConfig(model=model, dtype="float32", num_pages=64, page_size=16,
                                                  progress=False)), 0, None, self._routed, lambda message: None)
        self.steps.trace_to(StepTrace(trace_path))
        self.steps.start()

    def _routed(self, outputs: list[RequestOutput]) -> None:
        self.finished += [output.request_id for output in outputs if output.finish_reason is not None]

    def run_together(self, prompts: list[list[int]]) -> None:
        """Admits the prompts between two steps (so they are scheduled together) and waits until they are done."""
        ids = [f"r{len(self.finished) + i}" for i in range(len(prompts))]

        def admit() -> None:
            for request_id, prompt in zip(ids, prompts):
                self.steps.engine.add_request(request_id, prompt, GREEDY)

        asyncio.run(self.steps.call(admit))
        assert eventually(lambda: set(ids) <= set(self.finished), timeout_s=20)


@pytest.fixture
def traced(tiny_v2, tmp_path):
    loop = TracedLoop(tiny_v2, tmp_path / "trace.rank0")
    yield loop, tmp_path / "trace.rank0"
    loop.steps.stop()


def test_each_busy_step_is_one_line_whose_turn_ends_where_the_next_step_starts(traced):
    loop, path = traced
    loop.run_together([list(range(5, 45)), list(range(5, 25))])
    assert eventually(lambda: path.exists() and len(read_trace(path)) == 4, timeout_s=5)  # written once idle
    records = read_trace(path)
    assert [r.shape for r in records] == [
        StepShape(prefill_tokens=60, prefill_seqs=2),
        StepShape(decode_batch=2, decode_context=(41 + 21) / 2),
        StepShape(decode_batch=2, decode_context=(42 + 22) / 2),
        StepShape(decode_batch=2, decode_context=(43 + 23) / 2),
    ]
    for earlier, later in itertools.pairwise(records):
        assert earlier.t_s + earlier.turn_ms / 1000 == pytest.approx(later.t_s, abs=1e-5)
    assert all(0 < r.engine_ms <= r.turn_ms for r in records)
    assert all(0 <= r.wait_ms <= r.engine_ms for r in records)
    # the pool after each step: 3 + 2 pages of 16 held by the two sequences, all 64 free once both have finished
    assert [(r.free_pages, r.held_seqs) for r in records] == [(59, 2), (59, 2), (59, 2), (64, 0)]


def test_an_idle_wait_is_no_part_of_the_last_steps_turn(traced):
    loop, path = traced
    loop.steps.test_step_delay_s = 0.05  # every step takes at least this: a floor the turns can be checked against
    loop.run_together([list(range(5, 25))])
    time.sleep(0.6)  # idle, longer than the loop's idle block
    loop.run_together([list(range(5, 25))])
    loop.steps.stop()  # closes the trace
    records = read_trace(path)
    assert len(records) == 8  # a prefill and three decodes, twice
    assert all(50 <= r.turn_ms < 400 for r in records)
    assert records[4].t_s - records[3].t_s > 0.6 + records[3].turn_ms / 1000


def collect_cycles() -> None:
    """A collection with work of its own to do, so that its time shows whatever earlier tests left in the heap."""
    cycles = [[] for _ in range(200_000)]
    for cycle in cycles:
        cycle.append(cycle)
    del cycles
    gc.collect()


def test_a_turn_records_the_time_the_process_spent_collecting_garbage(traced):
    loop, path = traced
    engine = loop.steps.engine
    real_step = engine.step
    collected: list[bool] = []

    def step_collecting_once(*args, **kwargs):
        # The first step collects garbage before its work: inside its turn whatever the machine's load. (A collection
        # queued from the test thread between steps could land after the request had finished: it failed twice in
        # full CI runs, never alone nor in a run of the test folders before it.)
        if not collected:
            collect_cycles()
            collected.append(True)
        return real_step(*args, **kwargs)

    engine.step = step_collecting_once
    asyncio.run(loop.steps.call(lambda: engine.add_request("collected", list(range(5, 45)), GREEDY)))
    assert eventually(lambda: "collected" in loop.finished, timeout_s=20)
    loop.steps.stop()
    records = read_trace(path)
    assert collected and records[0].gc_ms > 0
    assert all(0 <= r.gc_ms <= r.turn_ms for r in records)


def test_the_gc_clock_counts_collections_until_closed():
    clock = GcClock()
    gc.collect()
    counted = clock.seconds
    clock.close()
    gc.collect()
    assert counted > 0 and clock.seconds == counted


def test_a_worker_started_with_step_trace_writes_its_ranks_file(tiny_v2, tmp_path):
    trace = tmp_path / "worker-trace"
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=0, num_decode=0, num_both=1,
                        worker_args=("--dtype", "float32", "--no-warmup", "--max-num-batched-tokens", "16",
                                     "--step-trace", str(trace)))
    with InProcessCluster(cfg) as cluster:
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        response = HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": list(range(7, 7 + 45)), "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
    records = read_trace(rank_trace_path(str(trace), "both", 0))
    # The 45-token prompt in budget-sized chunks (the last samples the first token), then four one-token decodes.
    assert [(r.shape.prefill_tokens, r.shape.decode_batch, r.shape.decode_context) for r in records] == [
        (16, 0, 0), (16, 0, 0), (13, 0, 0), (0, 1, 46), (0, 1, 47), (0, 1, 48), (0, 1, 49)]
    assert Path(rank_trace_path(str(trace), "both", 0)).read_bytes().endswith(b"\n")


def test_the_trace_summary_groups_decode_steps_by_batch_and_prefill_steps_by_tokens_and_prompts(tmp_path, capsys,
                                                                                                monkeypatch):
    from benchmarks import step_trace_summary

    trace = StepTrace(tmp_path / "t.rank0", flush_interval_s=3600)
    for shape, engine_ms in ((StepShape(40, 2000.0), 12.0), (StepShape(41, 2100.0), 14.0),
                             (StepShape(prefill_tokens=1500, prefill_seqs=1), 73.0),
                             (StepShape(prefill_tokens=8192, prefill_seqs=3), 120.0)):
        trace.record(shape, started_s=0.0, engine_ms=engine_ms, ended_s=engine_ms / 1000)
    trace.close()
    monkeypatch.setattr("sys.argv", ["step_trace_summary.py", str(tmp_path / "t.rank0")])
    step_trace_summary.main()
    out = capsys.readouterr().out
    assert "2 decode-only, 2 prefill-only" in out
    assert "| 32-63 | 2 | 2,050 | 13.0 / 13.8 |" in out  # percentiles interpolated between the two steps
    assert "| 1025-2048, one prompt | 1 | 1,500 | 73.0 / 73.0 |" in out
    assert "| 4097-8192, several prompts | 1 | 8,192 | 120.0 / 120.0 |" in out
