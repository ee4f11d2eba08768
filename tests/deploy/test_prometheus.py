"""Scrape configs built from the chart's settings, checked by promtool and run by a real Prometheus."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.prometheus import (
    ScrapeSettings,
    StaticTarget,
    config_yaml,
    kubernetes_scrape_job,
    prometheus_config,
    scrape_settings_from_chart,
    static_scrape_job,
)
from deploy.prometheus_local import prometheus_available

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
