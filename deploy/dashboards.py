"""The metric names the Grafana dashboards query, and the metrics contract in dashboards/metrics.md."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARDS_DIR = Path(__file__).resolve().parent.parent / "dashboards"
METRICS_CONTRACT = DASHBOARDS_DIR / "metrics.md"

METRIC_NAME = re.compile(r"\bpdserve_[a-zA-Z0-9_:]*")
HISTOGRAM_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")
CONTRACT_ROW = re.compile(r"^\|\s*`(pdserve_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|\s*([^|]*)\|")


def load_dashboards(dashboards_dir: Path = DASHBOARDS_DIR) -> dict[str, dict[str, Any]]:
    """File name -> parsed dashboard JSON, for every dashboards/*.json."""
    return {path.name: json.loads(path.read_text()) for path in sorted(dashboards_dir.glob("*.json"))}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets and query variables."""
    queries = [t["expr"] for p in _panels(dashboard.get("panels", [])) for t in p.get("targets", []) if "expr" in t]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def dashboard_metric_names(dashboards_dir: Path = DASHBOARDS_DIR) -> set[str]:
    """Series names the dashboards query, as they appear in /metrics (histograms as `_bucket`/`_sum`/`_count`)."""
    names: set[str] = set()
    for dashboard in load_dashboards(dashboards_dir).values():
        for query in dashboard_queries(dashboard):
            names.update(METRIC_NAME.findall(query))
    return names


def contract_metrics(contract: Path = METRICS_CONTRACT) -> dict[str, str]:
    """Metric family -> type (counter, gauge, histogram), from the tables in dashboards/metrics.md."""
    families = {}
    for line in contract.read_text().splitlines():
        row = CONTRACT_ROW.match(line)
        if row:
            families[row.group(1)] = row.group(2)
    return families


def metric_family(series_name: str, families: dict[str, str]) -> str | None:
    """The contract family a series name belongs to (`x_bucket` -> `x` for a histogram), or None."""
    if series_name in families:
        return series_name
    for suffix in HISTOGRAM_SERIES_SUFFIXES:
        base = series_name.removesuffix(suffix)
        if base != series_name and families.get(base) == "histogram":
            return base
    return None


def expand_grafana_variables(query: str, rate_interval: str = "1m") -> str:
    """A dashboard query as plain PromQL: every template variable matches all, $__rate_interval fixed."""
    query = query.replace("$__rate_interval", rate_interval)
    return re.sub(r'=~"\$\w+"', '=~".*"', query)
