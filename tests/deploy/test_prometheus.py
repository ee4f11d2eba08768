"""Scrape configs built from the chart's settings, checked by promtool and run by a real Prometheus."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from socketserver import BaseServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from deploy.dashboards import dashboard_queries, expand_grafana_variables, load_dashboards
from deploy.prometheus import (
    ScrapeSettings,
    StaticTarget,
    config_yaml,
    kubernetes_scrape_job,
    prometheus_config,
    scrape_settings_from_chart,
    static_scrape_job,
)
from deploy.prometheus_local import LocalPrometheus, prometheus_available

needs_prometheus = pytest.mark.skipif(not prometheus_available(), reason="needs prometheus and promtool (apt)")


def test_scrape_settings_follow_chart_values() -> None:
    assert scrape_settings_from_chart() == ScrapeSettings("/metrics", "15s", "10s")
    changed = scrape_settings_from_chart({"monitoring": {"scrapeInterval": "30s", "metricsPath": "/m"}})
    assert changed == ScrapeSettings("/m", "30s", "10s")


def test_kubernetes_job_keeps_annotated_pdserve_pods_on_their_http_port() -> None:
    job = kubernetes_scrape_job(ScrapeSettings("/metrics", "15s", "10s"))
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)] == "true"
    assert keeps[("__meta_kubernetes_pod_container_port_name",)] == "http"
    assert {r.get("target_label") for r in job["relabel_configs"]} >= {"component", "pool", "pod", "namespace"}


@needs_prometheus
def test_static_config_passes_promtool(tmp_path: Path) -> None:
    job = static_scrape_job(scrape_settings_from_chart(), [StaticTarget("127.0.0.1:8000", "router"),
                                                           StaticTarget("127.0.0.1:8100", "worker", "prefill")])
    path = tmp_path / "prometheus.yml"
    path.write_text(config_yaml(prometheus_config(job)))
    check = subprocess.run([shutil.which("promtool"), "check", "config", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _serve_router_latency_metrics() -> tuple[BaseServer, Histogram, Histogram, Counter]:
    """A stand-in router exposing the contract's latency metrics (the real router replaces it later)."""
    registry = CollectorRegistry()
    labels = ["model", "routing_policy"]
    ttft = Histogram("pdserve_time_to_first_token_seconds", "TTFT", labels, registry=registry)
    itl = Histogram("pdserve_inter_token_latency_seconds", "ITL", labels, registry=registry)
    requests = Counter("pdserve_requests_total", "requests", [*labels, "status"], registry=registry)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server, ttft, itl, requests


@needs_prometheus
@pytest.mark.timeout(60)
def test_real_prometheus_answers_the_dashboards_ttft_and_itl_queries(tmp_path: Path) -> None:
    server, ttft, itl, requests = _serve_router_latency_metrics()
    port = server.server_port
    settings = ScrapeSettings(scrape_settings_from_chart().metrics_path, "1s", "1s")
    config = prometheus_config(static_scrape_job(settings, [StaticTarget(f"127.0.0.1:{port}", "router")]), "1s")
    serving = load_dashboards()["pdserve-serving.json"]
    queries = [q for q in dashboard_queries(serving) if "time_to_first_token" in q or "inter_token" in q]
    assert len(queries) == 6
    try:
        with LocalPrometheus(config_yaml(config), tmp_path) as prometheus:
            prometheus.wait_for_data('up{job="pdserve", component="router"} == 1', timeout_s=30)
            deadline = time.monotonic() + 30
            step = 0
            while True:  # keep traffic flowing until rate() over the scrapes has data
                step += 1
                ttft.labels("m", "prefix").observe(0.05 * step)
                itl.labels("m", "prefix").observe(0.002 * step)
                requests.labels("m", "prefix", "200").inc()
                results = [prometheus.query(expand_grafana_variables(q, "10s")) for q in queries]
                if all(r and r[0]["value"][1] != "NaN" for r in results) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    finally:
        server.shutdown()
    for query, result in zip(queries, results, strict=True):
        assert result and 0 < float(result[0]["value"][1]) < 10, query
