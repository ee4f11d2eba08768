"""What the planner reads from the routers: requests, their lengths and latency quantiles between two scrapes of
real routers' /metrics, summed over routers."""

import time

import pytest
from probes import HTTP
from starlette.testclient import TestClient

from pdserve.planner.traffic import RouterCounters, Traffic, histogram_quantile, scrape_routers
from pdserve_router.app import build_router_app
from pdserve_router.config import RouterConfig

TIMEOUT_S = 60.0


def test_histogram_quantile_interpolates_within_the_bucket_of_the_rank():
    buckets = ((0.1, 50.0), (0.2, 90.0), (0.4, 100.0), (float("inf"), 100.0))
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1)
    assert histogram_quantile(buckets, 0.7) == pytest.approx(0.15)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.2 + 0.2 * 9 / 10)


def test_a_router_that_restarted_between_scrapes_reads_as_no_traffic_not_negative():
    later = RouterCounters(10.0, 3.0, 300.0, 30.0, ((1.0, 3.0), (float("inf"), 3.0)), ())
    earlier = RouterCounters(0.0, 50.0, 5000.0, 500.0, ((1.0, 50.0), (float("inf"), 50.0)), ())
    traffic = Traffic.between(earlier, later)
    assert traffic.request_rate == 0.0 and traffic.mean_prompt_tokens == 0.0 and traffic.itl_p99_s == 0.0


def test_the_rate_counts_requests_at_their_first_token_and_the_lengths_come_from_finished_ones():
    """A burst shows in the interval its first tokens come, before any of its requests has finished."""
    earlier = RouterCounters(0.0, 10.0, 1000.0, 100.0, ((1.0, 10.0), (float("inf"), 12.0)), ())
    burst = RouterCounters(10.0, 10.0, 1000.0, 100.0, ((1.0, 40.0), (float("inf"), 62.0)), ())
    traffic = Traffic.between(earlier, burst)
    assert traffic.request_rate == pytest.approx(5.0) and traffic.mean_prompt_tokens == 0.0
    assert traffic.ttft_p99_s == float(1.0)  # the 99th of 50 first tokens lies past the last finite bound
    finished = RouterCounters(20.0, 14.0, 1800.0, 180.0, burst.ttft, ())
    after = Traffic.between(burst, finished)
    assert after.request_rate == 0.0 and after.mean_prompt_tokens == pytest.approx(200.0)
    assert after.mean_output_tokens == pytest.approx(20.0)


def test_requests_through_a_real_router_are_counted_with_their_lengths(pd_cluster):
    url = pd_cluster.url
    model = HTTP.get(url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    earlier = scrape_routers(HTTP, [url], time.monotonic())
    for prompt_len, max_tokens in ((20, 4), (40, 8), (60, 12)):
        response = HTTP.post(url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": list(range(5, 5 + prompt_len)), "max_tokens": max_tokens, "ignore_eos": True,
            "stream": max_tokens == 8})
        assert response.status_code == 200, response.text
    # The same router twice: a planner in front of two routers sums them.
    later = scrape_routers(HTTP, [url, url], time.monotonic())
    once = scrape_routers(HTTP, [url], later.at_s)
    traffic = Traffic.between(earlier, once)
    assert traffic.request_rate * traffic.duration_s == pytest.approx(3)
    assert traffic.mean_prompt_tokens == pytest.approx(40)
    assert traffic.mean_output_tokens == pytest.approx(8)
    assert 0 < traffic.ttft_p99_s < TIMEOUT_S and 0 < traffic.itl_p99_s < TIMEOUT_S
    # One gap per token after each request's first, however the worker coalesced its tokens into events.
    assert once.itl[-1][1] - earlier.itl[-1][1] == pytest.approx(3 + 7 + 11)
    assert later.requests == pytest.approx(2 * once.requests)


def test_a_router_that_requires_api_keys_serves_its_metrics_to_the_planner_without_one(tiny_model_dir):
    """The planner sends no credential (the chart gives it none): a router's /metrics stays open, as its /health."""
    config = RouterConfig(model_dir=str(tiny_model_dir), served_model_name="tiny", api_keys=frozenset({"sk-test"}))
    client = TestClient(build_router_app(config))
    assert client.get("/v1/models").status_code == 401
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert RouterCounters.parse(0.0, [metrics.text]).requests == 0
