"""Every object the chart renders, for every value set, is valid for real Kubernetes releases."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from chart_objects import VALUE_SETS, render_objects
from kubernetes_validate.utils import latest_version

# The oldest release Chart.yaml's kubeVersion admits, and the newest one kubernetes-validate knows.
KUBERNETES_VERSIONS = ["1.29", latest_version()]

# CRDs are not in the Kubernetes schemas: their pod templates are checked as core PodTemplates, and the
# fields the chart sets are checked against these hand-written excerpts of the CRDs.
LEADER_WORKER_SET_SPEC = {
    "type": "object",
    "required": ["leaderWorkerTemplate"],  # replicas is optional (default 1); an autoscaled pool leaves it out
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "leaderWorkerTemplate": {
            "type": "object",
            "required": ["size", "workerTemplate"],
            "additionalProperties": False,
            "properties": {
                "size": {"type": "integer", "minimum": 1},
                "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                "leaderTemplate": {"type": "object"},
                "workerTemplate": {"type": "object"},
            },
        },
    },
}
POD_MONITOR_SPEC = {
    "type": "object",
    "required": ["selector", "podMetricsEndpoints"],
    "additionalProperties": False,
    "properties": {
        "selector": {"type": "object"},
        "podMetricsEndpoints": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "port": {"type": "string"},
                    "path": {"type": "string", "pattern": "^/"},
                    "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                    "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                    "relabelings": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"sourceLabels": {"type": "array"}, "targetLabel": {"type": "string"},
                                           "replacement": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
}
# A ServiceMonitor's endpoints take the same fields as a PodMonitor's podMetricsEndpoints.
SERVICE_MONITOR_SPEC = {
    "type": "object",
    "required": ["selector", "endpoints"],
    "additionalProperties": False,
    "properties": {"selector": {"type": "object"},
                   "endpoints": POD_MONITOR_SPEC["properties"]["podMetricsEndpoints"]},
}

DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"}
PROMETHEUS_RULE_SPEC = {
    "type": "object",
    "required": ["groups"],
    "additionalProperties": False,
    "properties": {"groups": {"type": "array", "items": {
        "type": "object",
        "required": ["name", "rules"],
        "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "rules": {"type": "array", "items": {
            "type": "object",
            "required": ["alert", "expr"],
            "additionalProperties": False,
            "properties": {"alert": {"type": "string"}, "expr": {"type": "string"}, "for": DURATION,
                           "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                           "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
        }}},
    }}},
}


def _validate(obj: dict[str, Any], version: str) -> None:
    if obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1":
        jsonschema.validate(obj["spec"], LEADER_WORKER_SET_SPEC)
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
            kubernetes_validate.validate(pod_template, version, strict=True)
    elif obj["kind"] == "PodMonitor":
        jsonschema.validate(obj["spec"], POD_MONITOR_SPEC)
    elif obj["kind"] == "ServiceMonitor":
        jsonschema.validate(obj["spec"], SERVICE_MONITOR_SPEC)
    elif obj["kind"] == "PrometheusRule":
        jsonschema.validate(obj["spec"], PROMETHEUS_RULE_SPEC)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_rendered_object_validates_against_kubernetes_schemas(value_set: str, version: str) -> None:
    objects = render_objects(VALUE_SETS[value_set])
    assert len(objects) >= 8
    failures = []
    for obj in objects:
        try:
            _validate(obj, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as err:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {err.message} at {list(err.absolute_path)}")
    assert not failures, "\n".join(failures)


def test_validation_catches_a_misspelled_pod_field() -> None:
    # Guards the test above: strict schemas must reject what Kubernetes would reject.
    deployment = next(o for o in render_objects() if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
