"""Value sets the chart is rendered with, and helpers to look inside a render (shared by tests/helm)."""

from __future__ import annotations

from typing import Any

import yaml

from deploy.chart import CHART_DIR, render_chart, rendered_objects

V3_VALUES = yaml.safe_load((CHART_DIR / "values-deepseek-v3.yaml").read_text())

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "multi-node-rdma": {
        "pools": {"prefill": {"ranks": 16, "multiNode": {"enabled": True, "nodes": 2}, "rdma": {"enabled": True}},
                  "decode": {"replicas": 3, "ranks": 32, "multiNode": {"enabled": True, "nodes": 4}}},
    },
    "operator-monitoring": {
        "monitoring": {"prometheusOperator": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                       "dashboards": {"enabled": False}},
    },
    "download-model-api-keys": {
        "model": {"source": "download", "download": {"repo": "org/small-model", "tokenSecret": "hf-token"}},
        "router": {"apiKeysSecret": "pdserve-keys", "service": {"type": "LoadBalancer"}},
    },
    "hostpath-colocated": {
        "model": {"source": "hostPath", "hostPath": {"path": "/models/dsv3"}},
        "pools": {"prefill": {"enabled": False}, "decode": {"enabled": False}, "both": {"enabled": True, "ranks": 4}},
        "serviceAccount": {"create": False, "name": "existing-sa"},
        "router": {"routing": {"policy": "least_load"}, "pdb": {"enabled": False}},
    },
    "pvc-subpath": {
        "model": {"source": "existingClaim", "existingClaim": {"claimName": "models", "subPath": "deepseek-v3"}},
        "engine": {"pageSize": 32, "gpuMemoryFraction": 0.8, "decodeReserveTokens": 256},
    },
    "deepseek-v3": V3_VALUES,
    "autoscaling-existing-secret": {
        "pools": {"decode": {"autoscaling": {"enabled": True, "maxReplicas": 8}},
                  "prefill": {"ranks": 2, "multiNode": {"enabled": True, "nodes": 2},
                              "autoscaling": {"enabled": True, "metric": "pdserve_num_requests_running"}}},
        "internalAuth": {"existingSecret": "my-pdserve-credentials"},
        "monitoring": {"prometheusOperator": {"enabled": True}},
    },
    "planner": {
        "planner": {"enabled": True, "profile": {"configMap": "v2-lite-h200-profile", "key": "h200.json"},
                    "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "cpu-only", "operator": "Exists"}]},
        "pools": {"decode": {"ranks": 2}},
        "router": {"apiKeysSecret": "pdserve-keys"},
    },
}


def render_objects(values: dict[str, Any] | None = None, *, include_tests: bool = True) -> list[dict[str, Any]]:
    return rendered_objects(render_chart(values), include_tests=include_tests)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_templates(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod template a workload object carries (LWS: leader and follower templates)."""
    templates = []
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            templates.append(obj["spec"]["template"])
        elif obj["kind"] == "LeaderWorkerSet":
            lwt = obj["spec"]["leaderWorkerTemplate"]
            templates += [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return templates


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector string with `k=v` and bare `k` (exists) terms, as the router passes it."""
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True


def arg_value(args: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} given {len(values)} times in {args}"
    return values[0]
