"""What the rendered chart promises an operator: the default values serve DeepSeek-V2-Lite and the V3 values use
expert parallelism; pools whose weights cannot fit are refused naming the numbers; credentials come from a Secret;
workers are fenced by NetworkPolicies, may read nothing in Kubernetes but pods, run as non-root, with every
capability dropped but IPC_LOCK; routers are ready only with a routable path and drain on rollout."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import pytest
from chart_objects import V3_VALUES, VALUE_SETS, arg_value, by_kind, named, pod_templates, render_objects

from deploy.chart import render_chart
from deploy.model_size import model_size

CONFIGS = Path(__file__).resolve().parents[2] / "pdserve" / "model" / "configs"


def _containers(template: dict) -> list[dict]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_default_values_serve_deepseek_v2_lite_on_one_gpu_per_rank() -> None:
    objects = render_objects()
    for name in ("pdserve-prefill", "pdserve-decode"):
        template = named(objects, "StatefulSet", name)["spec"]["template"]
        worker = template["spec"]["containers"][0]
        assert arg_value(worker["args"], "--ranks") == "1" and "--expert-parallel" not in worker["args"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        fetch = _env(template["spec"]["initContainers"][0])
        assert fetch["MODEL_REPO"]["value"] == "deepseek-ai/DeepSeek-V2-Lite-Chat"


@pytest.mark.parametrize(("config", "values"), [("deepseek-v2-lite", {}), ("deepseek-v3", V3_VALUES)])
def test_the_model_sizes_in_the_values_are_those_of_the_config(config: str, values: dict) -> None:
    size = model_size(json.loads((CONFIGS / f"{config}.json").read_text()))
    declared = values.get("model", {}).get("size") or {"replicatedParamsB": 1.31, "routedExpertParamsB": 14.39}
    assert declared == {"replicatedParamsB": round(size.replicated_params / 1e9, 2),
                        "routedExpertParamsB": round(size.routed_expert_params / 1e9, 2)}
    assert round(size.total_params / 1e9, 1) == {"deepseek-v2-lite": 15.7, "deepseek-v3": 671.0}[config]


def test_v3_values_serve_fp8_over_8_h200_ranks_on_one_node_per_instance() -> None:
    objects = render_objects(V3_VALUES)
    assert not by_kind(objects, "LeaderWorkerSet")
    for name in ("pdserve-prefill", "pdserve-decode"):
        container = named(objects, "StatefulSet", name)["spec"]["template"]["spec"]["containers"][0]
        assert {"--ranks=8", "--expert-parallel", "--fp8-weights=keep"} <= set(container["args"])
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert model_size(json.loads((CONFIGS / "deepseek-v3.json").read_text())).weight_gib_per_rank(8, 1) < 141 * 0.9 - 4


def test_two_byte_weights_do_not_ask_to_keep_fp8() -> None:
    for template in pod_templates(render_objects({})):
        for container in _containers(template):
            assert not any("--fp8-weights" in arg for arg in container.get("args", [])), container["name"]


@pytest.mark.parametrize(("values", "numbers"), [
    ({**V3_VALUES, "poolDefaults": {**V3_VALUES["poolDefaults"], "expertParallel": False}},
     ["pools.prefill", "624.9 GiB", "/ 1 expert shard", "126.9 GiB", "141"]),
    ({**V3_VALUES, "worker": {"gpuMemoryGiB": 80}}, ["92.1 GiB", "/ 8 expert shard", "72.0 GiB", "80"]),
    ({**V3_VALUES, "model": {**V3_VALUES["model"], "weightBytes": 2}}, ["184.1 GiB", "/ 8 expert shard"]),
    ({"worker": {"gpuMemoryGiB": 24}}, ["29.2 GiB", "21.6 GiB", "4 GiB must stay for the KV cache"]),
])
def test_pools_whose_weights_cannot_fit_are_refused_naming_the_numbers(values: dict, numbers: list[str]) -> None:
    with pytest.raises(helm.HelmRenderError) as refused:
        render_chart(values)
    for number in numbers:
        assert number in str(refused.value), (number, str(refused.value)[:600])


def test_v3_in_bf16_fits_16_h200_ranks_over_two_nodes() -> None:
    values = {**V3_VALUES, "model": {**V3_VALUES["model"], "weightBytes": 2},
              "poolDefaults": {**V3_VALUES["poolDefaults"], "ranks": 16, "multiNode": {"enabled": True, "nodes": 2}}}
    objects = render_objects(values)
    for name in ("pdserve-prefill", "pdserve-decode"):
        lws = named(objects, "LeaderWorkerSet", name)
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        assert "--ranks=16" in leader["args"][0] and "--fp8-weights" not in leader["args"][0]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_pod_runs_as_non_root_with_capabilities_dropped_and_a_read_only_root(value_set: str) -> None:
    for template in pod_templates(render_objects(VALUE_SETS[value_set])):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        for container in _containers(template):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
            assert security["capabilities"]["drop"] == ["ALL"]
            assert set(security["capabilities"].get("add", [])) <= {"IPC_LOCK"}
            assert {"/tmp"} <= {m["mountPath"] for m in container["volumeMounts"]}, container["name"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_router_and_worker_gets_the_internal_credential_from_a_secret(value_set: str) -> None:
    values = VALUE_SETS[value_set]
    objects = render_objects(values)
    secret_name = values.get("internalAuth", {}).get("existingSecret") or "pdserve-internal"
    secrets = by_kind(objects, "Secret")
    if values.get("internalAuth", {}).get("existingSecret"):
        assert not secrets
    else:
        assert {k for s in secrets for k in s["data"]} == {"internal-token", "ray-token"}
        assert all(len(v) >= 48 for s in secrets for v in s["data"].values())
    for template in pod_templates(objects):
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        container = template["spec"]["containers"][0]
        env = _env(container)
        text = json.dumps(container.get("args", []) + container.get("command", []))
        assert "internal-token" not in text and "PDSERVE_INTERNAL_TOKEN" not in text  # never on a command line
        if component in ("router", "worker"):
            assert env["PDSERVE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret_name,
                                                                                 "key": "internal-token"}
        if component.startswith("worker"):
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": "ray-token"}


def test_network_policies_fence_the_internal_api_the_channel_the_kv_ports_and_ray() -> None:
    objects = render_objects(VALUE_SETS["multi-node-rdma"])
    workers = named(objects, "NetworkPolicy", "pdserve-workers")
    assert workers["spec"]["policyTypes"] == ["Ingress"]
    http_rule, channel_rule, transfer_rule = workers["spec"]["ingress"]
    assert http_rule["ports"] == [{"port": 8100, "protocol": "TCP"}]
    release_pods = http_rule["from"][0]["podSelector"]["matchLabels"]
    assert release_pods == {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "pdserve"}
    assert channel_rule == {"ports": [{"port": 8101, "protocol": "TCP"}],
                            "from": [{"podSelector": {"matchLabels": release_pods}}]}
    assert http_rule["from"][1]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert transfer_rule["ports"] == [{"port": 40000, "endPort": 40999, "protocol": "TCP"}]
    assert transfer_rule["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["worker", "worker-follower"]
    for template in pod_templates(objects):
        if template["metadata"]["labels"]["app.kubernetes.io/component"].startswith("worker"):
            assert _env(template["spec"]["containers"][0])["UCX_TCP_PORT_RANGE"]["value"] == "40000-40999"
    for pool in ("prefill", "decode"):  # both multi-node here: Ray only between pods of the same pool
        ray = named(objects, "NetworkPolicy", f"pdserve-{pool}-ray")
        assert ray["spec"]["podSelector"]["matchLabels"]["pdserve.io/pool"] == pool
        assert ray["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
            **release_pods, "pdserve.io/pool": pool}}}]}]
    assert not [p for p in by_kind(render_objects(), "NetworkPolicy") if p["metadata"]["name"].endswith("-ray")]


def test_router_is_ready_only_with_a_routable_path_and_drains_on_rollout() -> None:
    router = named(render_objects(), "Deployment", "pdserve-router")["spec"]["template"]
    container = router["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert arg_value(container["args"], "--drain-timeout-s") == "600"
    assert router["spec"]["terminationGracePeriodSeconds"] == 600 + 10 + 15


def test_operator_monitoring_renders_a_service_monitor_for_routers_and_a_pod_monitor_for_workers() -> None:
    objects = render_objects(VALUE_SETS["operator-monitoring"])
    service_monitor = named(objects, "ServiceMonitor", "pdserve-router")
    router_service = named(objects, "Service", "pdserve-router")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= router_service["metadata"]["labels"].items()
    assert service_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pod_monitor = named(objects, "PodMonitor", "pdserve")
    assert pod_monitor["spec"]["selector"]["matchExpressions"][0]["values"] == ["worker"]


def test_autoscaling_renders_an_hpa_per_pool_on_a_pdserve_metric_and_leaves_replicas_to_it() -> None:
    objects = render_objects(VALUE_SETS["autoscaling-existing-secret"])
    decode = named(objects, "HorizontalPodAutoscaler", "pdserve-decode")["spec"]
    assert decode["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "pdserve-decode"}
    assert decode["maxReplicas"] == 8
    assert decode["metrics"][0]["pods"]["metric"]["name"] == "pdserve_num_requests_waiting"
    prefill = named(objects, "HorizontalPodAutoscaler", "pdserve-prefill")["spec"]
    assert prefill["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert "replicas" not in named(objects, "StatefulSet", "pdserve-decode")["spec"]
    assert not by_kind(render_objects(), "HorizontalPodAutoscaler")
    with pytest.raises(helm.HelmRenderError, match="minReplicas"):
        render_chart({"pools": {"decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}})
