"""The benchmark end to end against a real local cluster (router + prefill + decode on the tiny model)."""

import asyncio
import json

import pytest

from pdserve.bench.client import RunLimits, run_workload
from pdserve.bench.workload import BenchRequest, WorkloadConfig
from pdserve.cli.bench import add_bench_parser
from pdserve.cluster.local import ClusterConfig, LocalCluster


@pytest.fixture(scope="module")
def cluster(tiny_v2, ray_address, tmp_path_factory):
    cfg = ClusterConfig(tiny_v2, port=0, num_prefill=1, num_decode=1, start_timeout_s=120.0, ray_address=ray_address,
                        log_dir=str(tmp_path_factory.mktemp("bench-cluster")))
    with LocalCluster(cfg) as running:
        yield running


def _bench(argv: list[str]) -> int:
    import argparse

    top = argparse.ArgumentParser()
    add_bench_parser(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["bench", *argv])
    return args.func(args)


@pytest.mark.timeout(120)
def test_bench_run_writes_result_json_with_every_request_timed(cluster, tmp_path):
    out, plot = tmp_path / "result.json", tmp_path / "cdf.png"
    status = _bench(["run", "--url", cluster.url, "--preset", "shared-prefix-cpu", "--num-requests", "6",
                     "--prefix-groups", "2", "--system-prompt-len", "64", "--output-len", "4,6", "--max-concurrency",
                     "2", "--out", str(out), "--plot", str(plot), "--no-progress", "--label", "pd",
                     "--request-timeout-s", "60", "--run-timeout-s", "90"])
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert status == 0
    assert summary["num_requests"] == summary["completed"] == 6 and summary["failed"] == 0
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert set(summary[key]) == {"p50", "p90", "p99", "mean"}
    # Tokens that reach the client in one chunk are 0 s apart, so on a loaded machine ITL's median can be 0.
    assert summary["ttft_s"]["p50"] > 0 and summary["e2e_s"]["p50"] >= summary["ttft_s"]["p50"]
    assert summary["itl_s"]["p50"] >= 0 and summary["itl_s"]["p99"] >= summary["itl_s"]["p50"]
    assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
    assert 0 <= summary["goodput_requests_per_s"] <= summary["requests_per_s"]
    # Two groups of three requests over a 64-token system prompt: later requests must hit the prefill cache.
    assert 0 < summary["prefix_cache_hit_ratio"] < 1
    assert any("prefill" in key for key in result["prefix_cache_per_rank"])
    records = result["requests"]
    assert [r["index"] for r in records] == list(range(6))
    assert all(r["ok"] and r["output_tokens"] == r["max_tokens"] and len(r["itl_s"]) == r["output_tokens"] - 1
               for r in records)
    assert plot.stat().st_size > 0

    status = _bench(["compare", str(out), str(out)])
    assert status == 0


@pytest.mark.timeout(60)
def test_a_refused_request_is_a_failed_result_with_its_status_and_the_rest_are_timed(cluster):
    """The client's own paths: a 4xx answer is recorded as that request's error, the streamed one beside it counts."""
    refused = BenchRequest(index=0, arrival_s=0.0, prompt_token_ids=(5,) * 100_000, max_tokens=4, group=None,
                           conversation=0, turn=0, previous_turn=None)
    served = BenchRequest(index=1, arrival_s=0.0, prompt_token_ids=(5, 6, 7), max_tokens=4, group=None,
                          conversation=1, turn=0, previous_turn=None)
    results, _ = asyncio.run(run_workload(cluster.url, [refused, served], WorkloadConfig(num_requests=2, max_concurrency=2),
                                          RunLimits(request_timeout_s=30.0, run_timeout_s=45.0)))
    assert not results[0].ok and results[0].error.startswith("HTTP 400")
    assert results[1].ok and results[1].output_tokens == 4 and len(results[1].itl_s) == 3
