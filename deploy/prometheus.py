"""Prometheus scrape configs and alerting rules for pdserve, built from what the chart renders for the Prometheus
Operator.

Two shapes of one job: Kubernetes pod discovery by the chart's prometheus.io/* annotations (clusters
without the Prometheus Operator), and static targets (a local cluster of processes on one machine).
Both give each series the same `component` and `pool` labels as the chart's PodMonitor. The alerting rules are the
chart's PrometheusRule as a plain rule file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from deploy.chart import render_chart, rendered_objects

JOB_NAME = "pdserve"


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    metrics_path: str
    interval: str
    timeout: str


@dataclass(frozen=True, slots=True)
class StaticTarget:
    """One process to scrape: `host:port`, its component (router or worker) and, for workers, its pool."""

    address: str
    component: str
    pool: str = ""


def _operator_object(kind: str, values: dict[str, Any] | None, namespace: str) -> dict[str, Any]:
    """The one object of `kind` the chart renders with these values and the Prometheus Operator on."""
    operator_on = {"monitoring": {"prometheusOperator": {"enabled": True}}}
    merged = _deep_merge(values or {}, operator_on)
    found = [o for o in rendered_objects(render_chart(merged, namespace=namespace)) if o["kind"] == kind]
    if len(found) != 1:
        raise ValueError(f"expected one {kind} in the rendered chart, found {len(found)}")
    return found[0]


def scrape_settings_from_chart(values: dict[str, Any] | None = None) -> ScrapeSettings:
    """Path, interval and timeout of the PodMonitor the chart renders with these values."""
    endpoint = _operator_object("PodMonitor", values, "default")["spec"]["podMetricsEndpoints"][0]
    return ScrapeSettings(endpoint["path"], endpoint["interval"], endpoint["scrapeTimeout"])


def alert_rules_from_chart(values: dict[str, Any] | None = None, namespace: str = "default") -> dict[str, Any]:
    """The chart's PrometheusRule for a release in `namespace` as a Prometheus rule file ({"groups": [...]})."""
    return {"groups": _operator_object("PrometheusRule", values, namespace)["spec"]["groups"]}


def kubernetes_scrape_job(settings: ScrapeSettings) -> dict[str, Any]:
    """A scrape job finding pdserve pods through the chart's prometheus.io/* pod annotations."""
    meta = "__meta_kubernetes_pod_"
    return {
        "job_name": JOB_NAME,
        "metrics_path": settings.metrics_path,
        "scrape_interval": settings.interval,
        "scrape_timeout": settings.timeout,
        "kubernetes_sd_configs": [{"role": "pod"}],
        "relabel_configs": [
            {"source_labels": [meta + "label_app_kubernetes_io_part_of"], "regex": "pdserve", "action": "keep"},
            {"source_labels": [meta + "annotation_prometheus_io_scrape"], "regex": "true", "action": "keep"},
            # Pod discovery yields one target per container port; the metrics live on the port named http.
            {"source_labels": [meta + "container_port_name"], "regex": "http", "action": "keep"},
            {"source_labels": [meta + "annotation_prometheus_io_path"], "regex": "(.+)",
             "target_label": "__metrics_path__"},
            {"source_labels": ["__address__", meta + "annotation_prometheus_io_port"],
             "regex": r"([^:]+)(?::\d+)?;(\d+)", "replacement": "$1:$2", "target_label": "__address__"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": [meta + "name"], "target_label": "pod"},
            {"source_labels": [meta + "label_app_kubernetes_io_component"], "target_label": "component"},
            {"source_labels": [meta + "label_pdserve_io_pool"], "target_label": "pool"},
        ],
    }


def static_scrape_job(settings: ScrapeSettings, targets: list[StaticTarget]) -> dict[str, Any]:
    """The same job over fixed addresses, labelled as pod discovery would label them."""
    groups: dict[tuple[str, str], list[str]] = {}
    for target in targets:
        groups.setdefault((target.component, target.pool), []).append(target.address)
    return {
        "job_name": JOB_NAME,
        "metrics_path": settings.metrics_path,
        "scrape_interval": settings.interval,
        "scrape_timeout": settings.timeout,
        "static_configs": [
            {"targets": addresses, "labels": {"component": component, **({"pool": pool} if pool else {})}}
            for (component, pool), addresses in groups.items()
        ],
    }


def prometheus_config(job: dict[str, Any], evaluation_interval: str = "15s") -> dict[str, Any]:
    """A whole prometheus.yml holding one scrape job."""
    return {"global": {"evaluation_interval": evaluation_interval}, "scrape_configs": [job]}


def config_yaml(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False, width=120)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
