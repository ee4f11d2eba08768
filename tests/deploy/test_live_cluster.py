"""The dashboards and the scrape settings against a real local cluster (router + prefill + decode + colocated)."""

import dataclasses
import re
from pathlib import Path

import pytest

from deploy.dashboards import dashboard_metric_names, dashboard_queries, expand_grafana_variables, load_dashboards
from deploy.prometheus import StaticTarget, config_yaml, prometheus_config, scrape_settings_from_chart, static_scrape_job
from deploy.prometheus_local import LocalPrometheus, prometheus_available
from probes import HTTP


def send_traffic(cluster, count: int = 6) -> None:
    model = HTTP.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for i in range(count):
        response = HTTP.post(cluster.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": f"Shared system prompt for the dashboards. Request {i}.", "max_tokens": 6,
            "stream": i % 2 == 0})
        assert response.status_code == 200


def exposed_names(cluster) -> set[str]:
    names = set()
    for url in [cluster.url] + [w.url for w in cluster.workers]:
        text = HTTP.get(url + "/metrics", timeout=10).text
        names |= {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)}
    return names


def test_every_dashboard_metric_is_exposed_after_traffic(pd_cluster):
    send_traffic(pd_cluster)
    missing = dashboard_metric_names() - exposed_names(pd_cluster)
    assert not missing, f"dashboards query metrics no process exposes: {sorted(missing)}"


@pytest.mark.skipif(not prometheus_available(), reason="needs prometheus and promtool (Debian package)")
def test_real_prometheus_scrapes_the_cluster_and_answers_ttft_and_itl_queries(pd_cluster, tmp_path: Path):
    settings = dataclasses.replace(scrape_settings_from_chart(), interval="1s", timeout="1s")
    address = lambda url: url.removeprefix("http://")  # noqa: E731
    targets = [StaticTarget(address(pd_cluster.url), "router")] + [
        StaticTarget(address(w.url), "worker", w.name.split("-")[0]) for w in pd_cluster.workers]
    config = prometheus_config(static_scrape_job(settings, targets), "1s")
    queries = [q for dashboard in load_dashboards().values() for q in dashboard_queries(dashboard)
               if "time_to_first_token" in q or "inter_token_latency" in q]
    assert queries
    with LocalPrometheus(config_yaml(config), tmp_path) as prometheus:
        send_traffic(pd_cluster)
        prometheus.wait_for_data("pdserve_time_to_first_token_seconds_count", timeout_s=30)
        send_traffic(pd_cluster)
        for query in queries:
            assert prometheus.wait_for_data(expand_grafana_variables(query), timeout_s=30), query
