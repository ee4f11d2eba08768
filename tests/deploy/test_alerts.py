"""The chart's alerting rules: valid for Prometheus, reading only metrics of the contract, each firing when its
condition has held for its `for` (and only for the series that meet it, in the release's namespace only), by
promtool's rule unit tests: Prometheus's own evaluation of the rules over synthetic series. And one alert end to end:
a real Prometheus scraping a real cluster whose prefill worker stopped."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.dashboards import METRIC_NAME, contract_metrics, metric_family
from deploy.prometheus import (
    StaticTarget,
    alert_rules_from_chart,
    config_yaml,
    prometheus_config,
    scrape_settings_from_chart,
    static_scrape_job,
)
from deploy.prometheus_local import LocalPrometheus, prometheus_available
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from probes import HTTP

NAMESPACE = "pdserve"
RULES = alert_rules_from_chart(namespace=NAMESPACE)
ROUTER = {"namespace": NAMESPACE, "routing_policy": "prefix", "pod": "router-0"}
needs_promtool = pytest.mark.skipif(not prometheus_available(), reason="needs prometheus and promtool (apt)")


def rule(name: str) -> dict[str, Any]:
    return next(r for group in RULES["groups"] for r in group["rules"] if r["alert"] == name)


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    selector = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def histogram(name: str, labels: dict[str, str], per_minute: dict[str, int]) -> list[dict[str, str]]:
    """Cumulative buckets growing by `per_minute` observations (le -> count at or below) for 30 minutes."""
    return [series(f"{name}_bucket", labels | {"le": le}, f"0+{count}x30") for le, count in per_minute.items()]


def expected(alert: str, labels: dict[str, str]) -> dict[str, Any]:
    """The alert as it fires on a series with `labels`: its own labels added, annotations filled in."""
    definition = rule(alert)
    fill = lambda text: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)  # noqa: E731
    return {"exp_labels": labels | definition["labels"],
            "exp_annotations": {key: fill(text) for key, text in definition["annotations"].items()}}


def requests(model: str, per_minute: dict[str, int], namespace: str = NAMESPACE) -> list[dict[str, str]]:
    return [series("pdserve_requests_total", ROUTER | {"namespace": namespace, "model": model, "status": status},
                   f"0+{count}x30") for status, count in per_minute.items()]


# (alert, input series, [(minute, alerts expected then)]): each condition holds from the start.
SCENARIOS = [
    ("PdserveTimeToFirstTokenSLO",
     histogram("pdserve_time_to_first_token_seconds", ROUTER | {"model": "slow"}, {"1": 0, "5": 50, "+Inf": 50})
     + histogram("pdserve_time_to_first_token_seconds", ROUTER | {"model": "fast"}, {"1": 50, "5": 50, "+Inf": 50}),
     [(8, []), (20, [expected("PdserveTimeToFirstTokenSLO", {"namespace": NAMESPACE, "model": "slow"})])]),
    ("PdserveInterTokenLatencySLO",
     histogram("pdserve_inter_token_latency_seconds", ROUTER | {"model": "slow"}, {"0.025": 100, "0.1": 1000,
                                                                                  "+Inf": 1000})
     + histogram("pdserve_inter_token_latency_seconds", ROUTER | {"model": "fast"}, {"0.025": 1000, "0.1": 1000,
                                                                                    "+Inf": 1000}),
     [(8, []), (20, [expected("PdserveInterTokenLatencySLO", {"namespace": NAMESPACE, "model": "slow"})])]),
    ("PdserveRequestsFailing",
     requests("bad", {"ok": 100, "error": 3, "unavailable": 2}) + requests("good", {"ok": 100, "error": 0})
     + requests("bad", {"ok": 100, "error": 50}, namespace="another-release"),
     [(4, []), (15, [expected("PdserveRequestsFailing", {"namespace": NAMESPACE, "model": "bad"})])]),
    ("PdserveRequestsRateLimited",
     requests("full", {"ok": 100, "rate_limited": 20}) + requests("fine", {"ok": 100, "rate_limited": 1}),
     [(8, []), (20, [expected("PdserveRequestsRateLimited", {"namespace": NAMESPACE, "model": "full"})])]),
    ("PdserveNoRoutableWorker",
     [series("pdserve_router_healthy_workers", ROUTER | {"model": "m"}, "0x30"),
      series("pdserve_router_healthy_workers", ROUTER | {"model": "m", "pod": "router-1"}, "3x30")],
     [(1, []), (5, [expected("PdserveNoRoutableWorker", ROUTER | {"model": "m"})])]),
    ("PdservePrefillPoolDown",
     [series("pdserve_router_prefill_fallbacks_total", ROUTER | {"model": "down"}, "0+3x30"),
      series("pdserve_router_prefill_fallbacks_total", ROUTER | {"model": "up"}, "0x30")],
     [(4, []), (15, [expected("PdservePrefillPoolDown", {"namespace": NAMESPACE, "model": "down"})])]),
    ("PdserveKVTransfersFailing",
     [series("pdserve_kv_transfer_failures_total", {"namespace": NAMESPACE, "pod": "prefill-0", "model": "m",
                                                    "role": "prefill", "rank": "0"}, "0+1x30"),
      series("pdserve_kv_transfer_failures_total", {"namespace": NAMESPACE, "pod": "prefill-1", "model": "m",
                                                    "role": "prefill", "rank": "0"}, "0x30")],
     [(4, []), (15, [expected("PdserveKVTransfersFailing", {"namespace": NAMESPACE, "pod": "prefill-0"})])]),
    ("PdserveWorkerEjected",
     [series("pdserve_router_worker_ejections_total", ROUTER | {"model": "m", "worker": "http://w1"}, "0 0 0 1x27"),
      series("pdserve_router_worker_ejections_total", ROUTER | {"model": "m", "worker": "http://w2"}, "0x30")],
     [(2, []), (5, [expected("PdserveWorkerEjected", {"namespace": NAMESPACE, "worker": "http://w1"})]),
      (25, [])]),  # 15 minutes after, it is over
]


def test_every_rule_of_the_chart_has_a_scenario() -> None:
    assert sorted(r["alert"] for group in RULES["groups"] for r in group["rules"]) == sorted(s[0] for s in SCENARIOS)


def test_every_alert_reads_metrics_of_the_contract_in_the_release_namespace_only() -> None:
    families = contract_metrics()
    for group in RULES["groups"]:
        for definition in group["rules"]:
            names = METRIC_NAME.findall(definition["expr"])
            assert names and all(metric_family(name, families) for name in names), definition["expr"]
            selectors = re.findall(r"pdserve_\w+\{([^}]*)\}", definition["expr"])
            assert len(selectors) == len(names) and all(f'namespace="{NAMESPACE}"' in s for s in selectors)


def test_thresholds_and_labels_come_from_the_values() -> None:
    changed = alert_rules_from_chart({"monitoring": {"alerts": {"ttftP99Seconds": 0.5, "labels": {"team": "x"}}}})
    ttft = next(r for r in changed["groups"][0]["rules"] if r["alert"] == "PdserveTimeToFirstTokenSLO")
    assert ttft["expr"].endswith("> 0.5") and ttft["labels"] == {"severity": "warning", "team": "x"}


@needs_promtool
def test_the_rules_pass_promtool_and_fire_as_their_scenarios_say(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(config_yaml(RULES))
    check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": inputs,
         "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": alerts}
                             for minute, alerts in checks]}
        for alert, inputs, checks in SCENARIOS]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_a_scenario_that_should_not_fire_fails_the_check(tmp_path: Path) -> None:
    """Guards the test above: promtool must report an alert that fires where none is expected."""
    (tmp_path / "rules.yaml").write_text(config_yaml(RULES))
    alert, inputs, _ = SCENARIOS[2]  # requests failing
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": inputs,
         "alert_rule_test": [{"eval_time": "15m", "alertname": alert, "exp_alerts": []}]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0


@needs_promtool
def test_a_real_prometheus_raises_the_prefill_pool_alert_for_a_cluster_whose_prefill_worker_stopped(tiny_v2, tmp_path):
    """The rules as the chart renders them, loaded into a real Prometheus that scrapes a real router every second
    (labelled with the release's namespace, as pod discovery would): nothing is pending while the pair serves; once
    the prefill worker stops and the decode worker prefills for it, PdservePrefillPoolDown is pending."""
    (tmp_path / "rules.yaml").write_text(config_yaml(RULES))
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"))
    with InProcessCluster(cfg) as cluster:
        settings = dataclasses.replace(scrape_settings_from_chart(), interval="1s", timeout="1s")
        job = static_scrape_job(settings, [StaticTarget(cluster.url.removeprefix("http://"), "router")])
        for group in job["static_configs"]:
            group["labels"]["namespace"] = NAMESPACE
        config = prometheus_config(job, "1s") | {"rule_files": ["rules.yaml"]}
        with LocalPrometheus(config_yaml(config), tmp_path) as prometheus:
            model = HTTP.get(cluster.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            complete = lambda: HTTP.post(cluster.url + "/v1/completions", timeout=60, json={  # noqa: E731
                "model": model, "prompt": list(range(5, 45)), "max_tokens": 4, "temperature": 0})
            assert complete().status_code == 200
            prometheus.wait_for_data(f'pdserve_router_prefill_fallbacks_total{{namespace="{NAMESPACE}"}}', timeout_s=30)
            assert not prometheus.query('ALERTS{alertname="PdservePrefillPoolDown"}')

            cluster.kill(cluster.workers[0])  # the prefill worker
            assert [complete().status_code for _ in range(3)] == [200] * 3
            pending = prometheus.wait_for_data(
                'ALERTS{alertname="PdservePrefillPoolDown", alertstate="pending"}', timeout_s=30)
            assert pending[0]["metric"]["namespace"] == NAMESPACE and pending[0]["metric"]["model"] == model
