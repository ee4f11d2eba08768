"""The Grafana dashboards: valid current-schema JSON whose every queried metric is in the metrics contract."""

from __future__ import annotations

import pytest

from deploy.dashboards import (
    contract_metrics,
    dashboard_metric_names,
    dashboard_queries,
    expand_grafana_variables,
    load_dashboards,
    metric_family,
)

DASHBOARDS = load_dashboards()
PANELS_THE_ISSUE_ASKS_FOR = [
    "Time to first token", "Inter-token latency", "End-to-end request latency", "Requests by status",
    "Errors by status", "Tokens per second", "Running requests", "Waiting requests", "KV-cache usage",
    "Prefix-cache hit ratio", "Routed prefix match ratio", "KV transfer bandwidth", "KV transfer latency",
    "KV transfer failures",
]


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_there_are_dashboards_with_unique_uids() -> None:
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert len(uids) >= 2 and len(set(uids)) == len(uids)


@pytest.mark.parametrize("file_name", sorted(DASHBOARDS))
def test_dashboard_uses_current_schema_and_a_datasource_variable(file_name: str) -> None:
    dashboard = DASHBOARDS[file_name]
    assert dashboard["schemaVersion"] >= 39 and dashboard["id"] is None
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in _panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_workers_dashboard_filters_by_pool_and_rank() -> None:
    workers = DASHBOARDS["pdserve-workers.json"]
    assert {"pool", "rank"} <= {v["name"] for v in workers["templating"]["list"]}
    for panel in _panels(workers):
        assert all('role=~"$pool"' in t["expr"] and 'rank=~"$rank"' in t["expr"] for t in panel["targets"])


def test_every_panel_the_issue_asks_for_exists() -> None:
    titles = {p["title"] for d in DASHBOARDS.values() for p in _panels(d)}
    assert set(PANELS_THE_ISSUE_ASKS_FOR) <= titles
    latency = next(p for d in DASHBOARDS.values() for p in _panels(d) if p["title"] == "Time to first token")
    assert [t["legendFormat"] for t in latency["targets"]] == ["p50", "p90", "p99"]


def test_every_metric_a_dashboard_queries_is_in_the_contract() -> None:
    families = contract_metrics()
    names = dashboard_metric_names()
    assert "pdserve_time_to_first_token_seconds_bucket" in names and "pdserve_requests_total" in names
    assert {n for n in names if metric_family(n, families) is None} == set()


def test_every_contract_metric_is_shown_on_a_dashboard() -> None:
    families = contract_metrics()
    shown = {metric_family(n, families) for n in dashboard_metric_names()}
    assert set(families) - shown == set()


def test_contract_types_match_prometheus_naming() -> None:
    families = contract_metrics()
    assert len(families) == 41
    for name, kind in families.items():
        assert kind in ("counter", "gauge", "histogram")
        assert name.endswith("_total") == (kind == "counter"), name


def test_metric_family_accepts_histogram_series_only_for_histograms() -> None:
    families = {"a_seconds": "histogram", "b_total": "counter"}
    assert metric_family("a_seconds_bucket", families) == "a_seconds"
    assert metric_family("b_total_sum", families) is None
    assert metric_family("c_total", families) is None


def test_expanded_queries_are_plain_promql() -> None:
    for dashboard in DASHBOARDS.values():
        for query in dashboard_queries(dashboard):
            assert "$" not in expand_grafana_variables(query), query
