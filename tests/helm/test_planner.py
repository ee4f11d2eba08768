"""The SLO planner in the chart: off by default; on, one pod in the router's image that finds the routers and scales
the prefill and decode StatefulSets, allowed exactly that; refused beside an HPA and with a pool it cannot scale."""

from __future__ import annotations

import argparse
from typing import Any

import helm_python as helm
import pytest
from chart_objects import VALUE_SETS, arg_value, by_kind, named, pod_templates, render_objects, selector_matches

from deploy.chart import CHART_DIR, render_chart, rendered_objects
from pdserve.planner.config import PlannerConfig, add_planner_arguments, planner_config_from_args

PLANNER = VALUE_SETS["planner"]


def _planner_pod(objects: list[dict]) -> dict:
    return named(objects, "Deployment", "pdserve-planner")["spec"]["template"]


def _planner_args(objects: list[dict]) -> list[str]:
    return _planner_pod(objects)["spec"]["containers"][0]["args"]


def test_the_planner_is_off_by_default_and_the_pools_keep_their_replicas() -> None:
    objects = render_objects()
    assert not [o for o in objects if o["metadata"]["name"].endswith("-planner")]
    assert all(t["metadata"]["labels"]["app.kubernetes.io/component"] != "planner" for t in pod_templates(objects))
    assert [s["spec"]["replicas"] for s in by_kind(objects, "StatefulSet")] == [1, 1]


def test_the_planner_finds_the_routers_and_scales_both_pools_of_its_release() -> None:
    objects = rendered_objects(render_chart(PLANNER, release="serving", namespace="inference"))
    deployment = named(objects, "Deployment", "serving-pdserve-planner")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "planner" and container["image"] == "ghcr.io/pdserve/pdserve-router:0.1.0"
    assert arg_value(args, "--discovery") == "k8s" and arg_value(args, "--pools") == "kubernetes"
    assert arg_value(args, "--k8s-namespace") == "inference"
    for pool, ranks in (("prefill", "1"), ("decode", "2")):
        statefulset = named(objects, "StatefulSet", arg_value(args, f"--{pool}-statefulset"))
        assert statefulset["metadata"]["name"] == f"serving-pdserve-{pool}"
        assert "replicas" not in statefulset["spec"]  # the planner's, not reset by an upgrade
        assert arg_value(args, f"--{pool}-ranks-per-worker") == ranks
    selector = arg_value(args, "--k8s-router-selector")
    matched = {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in pod_templates(objects)
               if selector_matches(selector, t["metadata"]["labels"])}
    assert matched == {"router"}
    assert arg_value(args, "--profile") == "/etc/pdserve/profile/h200.json"
    profile = next(v for v in pod["spec"]["volumes"] if v["name"] == "profile")["configMap"]
    assert profile == {"name": "v2-lite-h200-profile", "items": [{"key": "h200.json", "path": "h200.json"}]}
    assert {"name": "profile", "mountPath": "/etc/pdserve/profile", "readOnly": True} in container["volumeMounts"]
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"} and pod["spec"]["tolerations"][0]["key"] == "cpu-only"


def test_the_planners_role_allows_finding_routers_and_scaling_the_two_pools_and_nothing_more() -> None:
    objects = render_objects(PLANNER)
    role = named(objects, "Role", "pdserve-planner")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
         "resourceNames": ["pdserve-prefill", "pdserve-decode"], "verbs": ["get", "patch"]},
    ]
    binding = named(objects, "RoleBinding", "pdserve-planner")
    assert binding["roleRef"]["name"] == "pdserve-planner"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdserve-planner", "namespace": "default"}]
    assert _planner_pod(objects)["spec"]["serviceAccountName"] == "pdserve-planner"
    assert named(objects, "ServiceAccount", "pdserve-planner")
    # The router's and workers' Role is unchanged and does not bind the planner.
    assert "pdserve-planner" not in [s["name"] for s in named(objects, "RoleBinding", "pdserve-pod-reader")["subjects"]]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")


def test_without_created_service_accounts_the_planner_runs_as_the_one_named() -> None:
    objects = render_objects({**PLANNER, "serviceAccount": {"create": False, "plannerName": "planner-sa"}})
    assert _planner_pod(objects)["spec"]["serviceAccountName"] == "planner-sa"
    assert not by_kind(objects, "Role") and not by_kind(objects, "ServiceAccount")


@pytest.mark.parametrize(("values", "message"), [
    ({"pools": {"decode": {"autoscaling": {"enabled": True}}}},
     r"planner.enabled and pools.decode.autoscaling.enabled are both on: the planner replaces"),
    ({"poolDefaults": {"autoscaling": {"enabled": True}}}, r"pools.prefill.autoscaling.enabled are both on"),
    ({"pools": {"prefill": {"enabled": False}, "both": {"enabled": True}}},
     r"planner.enabled needs pools.prefill.enabled"),
    ({"pools": {"decode": {"ranks": 2, "multiNode": {"enabled": True, "nodes": 2}}}},
     r"planner.enabled needs pools.decode.multiNode.enabled off: the planner scales StatefulSets"),
    ({"planner": {"enabled": True, "minDecode": 5, "maxDecode": 2}}, r"planner: minDecode \(5\) is above maxDecode"),
])
def test_the_chart_refuses_a_planner_beside_an_hpa_or_with_a_pool_it_cannot_scale(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_chart({"planner": {"enabled": True}, **values})


def test_the_planner_gets_no_internal_credential_and_no_network_policy_keeps_it_from_the_routers() -> None:
    """The routers' /metrics is open (tests/planner/test_traffic.py): the planner needs only to reach their port."""
    objects = render_objects(PLANNER)
    planner = _planner_pod(objects)
    assert "env" not in planner["spec"]["containers"][0]
    router = named(objects, "Deployment", "pdserve-router")["spec"]["template"]
    port = router["spec"]["containers"][0]["ports"][0]["containerPort"]
    for policy in by_kind(objects, "NetworkPolicy"):
        if _selects(policy["spec"]["podSelector"], router["metadata"]["labels"]):
            assert any(_admits(rule, planner["metadata"]["labels"], port) for rule in policy["spec"].get("ingress", []))


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In, NotIn, Exists, DoesNotExist) against pod labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    tests = {"In": lambda e: labels.get(e["key"]) in e["values"],
             "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
             "Exists": lambda e: e["key"] in labels, "DoesNotExist": lambda e: e["key"] not in labels}
    return all(tests[e["operator"]](e) for e in selector.get("matchExpressions", []))


def _admits(rule: dict[str, Any], labels: dict[str, str], port: int) -> bool:
    """Whether an ingress rule lets a pod of this namespace with `labels` in on `port`."""
    ports = rule.get("ports")
    if ports and not any("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]) for p in ports):
        return False
    peers = rule.get("from")
    return not peers or any("namespaceSelector" not in peer and _selects(peer.get("podSelector", {}), labels)
                            for peer in peers)


# Flags the chart sets to values of its own on purpose; every other flag it passes must be the code's default.
CHART_CHOSEN = {"--discovery", "--k8s-namespace", "--k8s-router-selector", "--prefill-statefulset",
                "--decode-statefulset", "--prefill-ranks-per-worker", "--decode-ranks-per-worker"}


def _config(args: list[str]) -> PlannerConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_planner_arguments(parser)
    return planner_config_from_args(parser.parse_args(args))


def test_planner_flags_parse_and_the_values_defaults_are_the_code_defaults() -> None:
    args = _planner_args(render_objects({"planner": {"enabled": True}}))[1:]
    config = _config(args)
    assert config == _config([a for a in args if a.partition("=")[0] in CHART_CHOSEN])
    assert config.k8s_router_selector.endswith("app.kubernetes.io/component=router")


def test_planner_values_reach_its_flags() -> None:
    values = {"planner": {"enabled": True, "slo": {"ttftSeconds": 0.5, "itlSeconds": 0.025}, "intervalSeconds": 15,
                          "lookaheadSeconds": 0, "scaleDownWindowSeconds": 600, "minPrefill": 2, "maxPrefill": 3,
                          "minDecode": 4, "maxDecode": 16, "extraArgs": ["--itl-headroom=0.7"]}}
    config = _config(_planner_args(render_objects(values))[1:])
    assert (config.slo_ttft_s, config.slo_itl_s, config.interval_s) == (0.5, 0.025, 15.0)
    assert (config.lookahead_s, config.scale_down_window_s, config.itl_headroom) == (0.0, 600.0, 0.7)
    assert (config.min_prefill, config.max_prefill, config.min_decode, config.max_decode) == (2, 3, 4, 16)
    assert config.profile == ""  # no ConfigMap: the built-in profile


def test_helm_lint_strict_passes_with_the_planner_on() -> None:
    report = helm.lint(CHART_DIR, PLANNER, strict=True, kube_version="v1.29.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
