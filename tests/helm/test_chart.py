"""What the rendered chart means: discovery contract, GPU sizing, draining, RBAC, storage, monitoring."""

from __future__ import annotations

import argparse
import json
import re
import tarfile
from pathlib import Path

import helm_python as helm
import pytest
from chart_objects import (
    VALUE_SETS,
    arg_value,
    by_kind,
    named,
    pod_templates,
    render_objects,
    selector_matches,
)

from deploy.chart import CHART_DIR
from deploy.dashboards import DASHBOARDS_DIR

ROUTER = "pdserve-router"


def _router_args(objects: list[dict]) -> list[str]:
    return named(objects, "Deployment", ROUTER)["spec"]["template"]["spec"]["containers"][0]["args"]


def _container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def _serving_templates(objects: list[dict]) -> list[dict]:
    return [t for t in pod_templates(objects) if t["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]


def test_default_render_has_router_both_pools_rbac_pdbs_and_dashboards() -> None:
    objects = render_objects()
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    for expected in ["Deployment/pdserve-router", "Service/pdserve-router", "StatefulSet/pdserve-prefill",
                     "StatefulSet/pdserve-decode", "Service/pdserve-prefill", "Service/pdserve-decode",
                     "ServiceAccount/pdserve", "Role/pdserve-pod-reader", "RoleBinding/pdserve-pod-reader",
                     "PodDisruptionBudget/pdserve-router", "PodDisruptionBudget/pdserve-prefill",
                     "ConfigMap/pdserve-engine", "ConfigMap/pdserve-dashboards", "Pod/pdserve-test-completion"]:
        assert expected in kinds
    assert not by_kind(objects, "LeaderWorkerSet") and not by_kind(objects, "PodMonitor")


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_router_discovers_exactly_the_serving_worker_pods(value_set: str) -> None:
    objects = render_objects(VALUE_SETS[value_set])
    args = _router_args(objects)
    selector = arg_value(args, "--k8s-label-selector")
    assert arg_value(args, "--discovery") == "k8s" and arg_value(args, "--k8s-namespace") == "default"
    for template in pod_templates(objects):
        labels = template["metadata"]["labels"]
        serving = labels["app.kubernetes.io/component"] == "worker"
        assert selector_matches(selector, labels) == serving, labels
        if serving:
            container = _container(template)
            assert [p["name"] for p in container["ports"]][0] == "http"
            role_arg = re.search(r"--role=(\w+)", " ".join(container["command"] + container["args"])).group(1)
            assert labels["pdserve.io/role"] == role_arg


def test_routing_policy_and_weights_come_from_values() -> None:
    args = _router_args(render_objects({"router": {"routing": {"policy": "round_robin", "prefixWeight": 2.5,
                                                                "loadWeight": 0.5, "localPrefillMaxTokens": 512,
                                                                "localPrefillMaxStallMs": 40}}}))
    assert arg_value(args, "--routing") == "round_robin"
    assert float(arg_value(args, "--prefix-weight")) == 2.5 and float(arg_value(args, "--load-weight")) == 0.5
    assert arg_value(args, "--local-prefill-max-tokens") == "512" and arg_value(args, "--local-prefill-min-queue") == "1"
    assert float(arg_value(args, "--local-prefill-min-wait-ms")) == 0
    assert float(arg_value(args, "--local-prefill-max-stall-ms")) == 40


def test_the_prefill_fallback_and_separate_reasoning_are_on_unless_values_turn_them_off() -> None:
    assert not {"--no-prefill-fallback", "--no-separate-reasoning"} & set(_router_args(render_objects()))
    off = _router_args(render_objects({"router": {"routing": {"prefillFallback": False}, "separateReasoning": False}}))
    assert {"--no-prefill-fallback", "--no-separate-reasoning"} <= set(off)


def test_single_node_workers_request_one_gpu_per_rank() -> None:
    objects = render_objects({"pools": {"decode": {"ranks": 4, "replicas": 3}}})
    decode = named(objects, "StatefulSet", "pdserve-decode")
    resources = _container(decode["spec"]["template"])["resources"]
    assert decode["spec"]["replicas"] == 3
    assert resources["limits"]["nvidia.com/gpu"] == 4 and resources["requests"]["nvidia.com/gpu"] == 4
    assert "--ranks=4" in _container(decode["spec"]["template"])["args"]


def test_multi_node_instance_is_a_leader_worker_set_splitting_ranks_over_nodes() -> None:
    objects = render_objects(VALUE_SETS["multi-node-rdma"])
    lws = named(objects, "LeaderWorkerSet", "pdserve-decode")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 3 and lwt["size"] == 4
    leader, follower = _container(lwt["leaderTemplate"]), _container(lwt["workerTemplate"])
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 8 == follower["resources"]["limits"]["nvidia.com/gpu"]
    assert "--ranks=32" in leader["args"][0] and "--ray-address=127.0.0.1:6379" in leader["args"][0]
    assert "LWS_LEADER_ADDRESS" in follower["args"][0] and "ports" not in follower
    assert not [s for s in by_kind(objects, "StatefulSet") if s["metadata"]["name"] == "pdserve-decode"]
    prefill = _container(named(objects, "LeaderWorkerSet", "pdserve-prefill")["spec"]["leaderWorkerTemplate"]
                         ["leaderTemplate"])
    assert prefill["resources"]["limits"]["rdma/ib"] == 1


def test_ranks_that_do_not_divide_among_nodes_fail_with_a_clear_message() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"pools.decode: ranks \(12\) must divide evenly .* \(5\)"):
        render_objects({"pools": {"decode": {"ranks": 12, "multiNode": {"enabled": True, "nodes": 5}}}})


def test_a_host_kv_tier_reaches_the_pools_workers_and_must_fit_the_pods_memory_limit() -> None:
    objects = render_objects({"pools": {"prefill": {"ranks": 2, "hostKvCacheGiB": 48}}})  # 2 x 48 + 16 <= 128 GiB
    prefill = _container(named(objects, "StatefulSet", "pdserve-prefill")["spec"]["template"])
    decode = _container(named(objects, "StatefulSet", "pdserve-decode")["spec"]["template"])
    assert "--host-kv-cache-gib=48" in prefill["args"]
    assert not [a for a in decode["args"] if a.startswith("--host-kv-cache-gib")]
    with pytest.raises(helm.HelmRenderError, match=r"pools.prefill: 2 rank\(s\) a pod x hostKvCacheGiB 64 .* 144 GiB"
                                                    r".*limits.memory is 128Gi"):
        render_objects({"pools": {"prefill": {"ranks": 2, "hostKvCacheGiB": 64}}})
    render_objects({"pools": {"prefill": {"ranks": 2, "hostKvCacheGiB": 64,
                                          "resources": {"limits": {"memory": "1Ti"}}}}})


def test_worker_pods_have_shm_ipc_lock_health_probes_and_a_drain_grace_period() -> None:
    objects = render_objects({"worker": {"terminationGracePeriodSeconds": 300, "preStopSleepSeconds": 7,
                                         "shmSize": "32Gi"}})
    for template in _serving_templates(objects):
        spec, container = template["spec"], _container(template)
        assert spec["terminationGracePeriodSeconds"] == 300 + 7 + 15  # drain + preStop + exit margin
        assert "--drain-timeout-s=300" in " ".join(container.get("command", []) + container.get("args", []))
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 1800
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_router_and_workers_may_only_read_pods_in_their_namespace() -> None:
    """The router discovers workers, workers their hand-off peers: an identity each, allowed only that."""
    objects = render_objects()
    role = named(objects, "Role", "pdserve-pod-reader")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = named(objects, "RoleBinding", "pdserve-pod-reader")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "default"}
                                   for name in ("pdserve", "pdserve-worker")]
    accounts = {t["metadata"]["labels"]["app.kubernetes.io/component"]: t["spec"]["serviceAccountName"]
                for t in pod_templates(objects)}
    assert accounts == {"router": "pdserve", "worker": "pdserve-worker"}
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")


def test_router_runs_the_torch_free_image_and_workers_the_gpu_image() -> None:
    objects = render_objects({"image": {"tag": "1.2.3"}})
    router_image = _container(named(objects, "Deployment", ROUTER)["spec"]["template"])["image"]
    assert router_image == "ghcr.io/pdserve/pdserve-router:1.2.3"
    assert {_container(t)["image"] for t in _serving_templates(objects)} == {"ghcr.io/pdserve/pdserve:1.2.3"}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_services_and_pdbs_select_rendered_pods_of_their_component(value_set: str) -> None:
    objects = render_objects(VALUE_SETS[value_set])
    templates = pod_templates(objects)
    for obj in by_kind(objects, "Service") + by_kind(objects, "PodDisruptionBudget"):
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        matched = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert matched, f"{obj['kind']}/{obj['metadata']['name']} selects no pod"
        if obj["kind"] == "Service":
            assert all("http" in [p["name"] for p in _container(t).get("ports", [])] for t in matched)


def test_scrape_annotations_without_operator_and_a_pod_monitor_with_it() -> None:
    plain = render_objects()
    for template in [named(plain, "Deployment", ROUTER)["spec"]["template"]] + _serving_templates(plain):
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert annotations["prometheus.io/port"] == str(_container(template)["ports"][0]["containerPort"])
    operator = render_objects(VALUE_SETS["operator-monitoring"])
    monitor = named(operator, "PodMonitor", "pdserve")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    for template in pod_templates(operator):
        assert "prometheus.io/scrape" not in template["metadata"].get("annotations", {})


def test_dashboards_config_map_carries_every_dashboard_file_verbatim() -> None:
    config_map = named(render_objects(), "ConfigMap", "pdserve-dashboards")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p.read_text() for p in DASHBOARDS_DIR.glob("*.json")}
    assert len(files) >= 2 and config_map["data"] == files
    without = by_kind(render_objects(VALUE_SETS["operator-monitoring"]), "ConfigMap")
    assert [c["metadata"]["name"] for c in without] == ["pdserve-engine"]


def test_packaged_chart_holds_the_dashboards_as_real_files(tmp_path: Path) -> None:
    archive = helm.package(CHART_DIR, destination=tmp_path)
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        for path in DASHBOARDS_DIR.glob("*.json"):
            member = members[f"pdserve/dashboards/{path.name}"]
            assert member.isfile()
            assert json.loads(tar.extractfile(member).read()) == json.loads(path.read_text())


@pytest.mark.parametrize(
    ("value_set", "volume_key"),
    [("pvc-subpath", "persistentVolumeClaim"), ("hostpath-colocated", "hostPath"), ("defaults", "emptyDir")],
)
def test_model_source_picks_the_model_volume(value_set: str, volume_key: str) -> None:
    objects = render_objects(VALUE_SETS[value_set])
    for template in pod_templates(objects):
        model = next(v for v in template["spec"]["volumes"] if v["name"] == "model")
        assert volume_key in model
        mount = next(m for m in _container(template)["volumeMounts"] if m["name"] == "model")
        assert mount["mountPath"] == "/model" and mount["readOnly"] is True
        init = template["spec"].get("initContainers", [])
        assert bool(init) == (volume_key == "emptyDir")


def test_download_fetches_only_tokenizer_files_for_the_router_and_everything_for_workers() -> None:
    objects = render_objects(VALUE_SETS["download-model-api-keys"])
    router = named(objects, "Deployment", ROUTER)["spec"]["template"]
    env = {e["name"]: e.get("value") for e in router["spec"]["initContainers"][0]["env"]}
    assert env["MODEL_REPO"] == "org/small-model" and "tokenizer.json" in env["MODEL_FILES"]
    for template in _serving_templates(objects):
        worker_env = {e["name"]: e for e in template["spec"]["initContainers"][0]["env"]}
        assert worker_env["MODEL_FILES"]["value"] == ""
        assert worker_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert "--api-keys-file=/secrets/keys" in router["spec"]["containers"][0]["args"]


def test_existing_claim_sub_path_is_mounted() -> None:
    objects = render_objects(VALUE_SETS["pvc-subpath"])
    for template in pod_templates(objects):
        mount = next(m for m in _container(template)["volumeMounts"] if m["name"] == "model")
        assert mount["subPath"] == "deepseek-v3"


def test_engine_settings_reach_workers_through_the_config_map_and_roll_them() -> None:
    defaults, changed = render_objects(), render_objects(VALUE_SETS["pvc-subpath"])
    assert named(changed, "ConfigMap", "pdserve-engine")["data"]["PDSERVE_PAGE_SIZE"] == "32"
    assert named(changed, "ConfigMap", "pdserve-engine")["data"]["PDSERVE_GPU_MEMORY_FRACTION"] == "0.8"
    assert named(changed, "ConfigMap", "pdserve-engine")["data"]["PDSERVE_DECODE_RESERVE_TOKENS"] == "256"
    for before, after in zip(_serving_templates(defaults), _serving_templates(changed), strict=True):
        container = _container(after)
        assert "--page-size=$(PDSERVE_PAGE_SIZE)" in container["args"]
        assert "--decode-reserve-tokens=$(PDSERVE_DECODE_RESERVE_TOKENS)" in container["args"]
        assert container["envFrom"] == [{"configMapRef": {"name": "pdserve-engine"}}]
        key = "checksum/engine-config"
        assert before["metadata"]["annotations"][key] != after["metadata"]["annotations"][key]


def test_helm_test_hook_sends_a_completion_through_the_router_service() -> None:
    objects = render_objects({"router": {"apiKeysSecret": "keys"}, "tests": {"expect": "Paris"}})
    pod = named(objects, "Pod", "pdserve-test-completion")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = _container(pod)
    script = container["args"][0]
    assert 'url="http://pdserve-router:8000"' in script and "/v1/completions" in script
    env = {e["name"]: e for e in container["env"]}
    assert env["EXPECT"]["value"] == "Paris" and env["API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "keys"


def test_notes_tell_how_to_reach_the_router() -> None:
    from deploy.chart import render_chart

    notes = render_chart()["pdserve/templates/NOTES.txt"]
    assert "port-forward svc/pdserve-router 8000:8000" in notes and "helm test pdserve" in notes


def test_every_value_in_values_yaml_has_a_comment() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    documented_parents: list[tuple[int, bool]] = []  # (indent, has "# --" comment) of enclosing keys
    missing = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        documented_parents = [p for p in documented_parents if p[0] < indent]
        commented = number > 0 and lines[number - 1].strip().startswith("#")
        is_leaf = rest not in ("", "|")
        if is_leaf and not commented and not any(doc for _, doc in documented_parents):
            missing.append(f"line {number + 1}: {key}")
        documented_parents.append((indent, commented))
    assert not missing, missing


def test_helm_lint_strict_finds_no_warnings_or_errors() -> None:
    report = helm.lint(CHART_DIR, strict=True, kube_version="v1.29.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# Flags the chart sets on purpose to other values than the code's defaults, and why.
CHART_CHOSEN = {
    "--host": "listen on the pod's interfaces", "--port": "the chart's port", "--model": "the mounted model",
    "--channel-port": "a fixed port the NetworkPolicy names",
    "--discovery": "pods through Kubernetes", "--k8s-namespace": "the release's", "--k8s-label-selector": "the release's",
    "--drain-timeout-s": "bounded by the pod's grace period", "--role": "the pool's", "--ranks": "the pool's",
    "--advertise-url": "the pod's IP", "--page-size": "64-token pages on GPUs: fewer, larger KV transfer descriptors",
}
POD_ENV = {"POD_IP": "10.0.0.7"}


def _parsed(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def _expand(args: list[str], objects: list[dict]) -> list[str]:
    """The container's args with $(VAR) replaced as the kubelet would, from the engine ConfigMap and the pod."""
    env = POD_ENV | named(objects, "ConfigMap", "pdserve-engine")["data"]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def _only_chosen(args: list[str]) -> list[str]:
    return [arg for arg in args if arg.partition("=")[0] in CHART_CHOSEN]


def test_flags_the_chart_passes_parse_and_unchosen_ones_are_the_code_defaults(monkeypatch) -> None:
    """Configuration has one set of defaults: the config the chart's flags build equals the one built from only the
    flags it chooses on purpose, so every other value it passes is the code's own default."""
    from pdserve.worker.config import add_worker_arguments, worker_config_from_args
    from pdserve_router.config import add_router_arguments, router_config_from_args
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "t0ken")
    objects = render_objects()
    router_args = _router_args(objects)[1:]
    config = router_config_from_args(_parsed(add_router_arguments, router_args))
    assert config == router_config_from_args(_parsed(add_router_arguments, _only_chosen(router_args)))
    assert {"--routing", "--prefix-weight", "--load-weight"} <= {a.partition("=")[0] for a in router_args}
    for template in _serving_templates(objects):
        worker_args = _expand(_container(template)["args"][1:], objects)
        config = worker_config_from_args(_parsed(add_worker_arguments, worker_args), "/model")
        assert config == worker_config_from_args(_parsed(add_worker_arguments, _only_chosen(worker_args)), "/model")
        assert config.engine.gpu_memory_fraction == 0.9 and config.url == "http://10.0.0.7:8100"
