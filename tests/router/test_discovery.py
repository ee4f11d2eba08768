"""Discovery. The Kubernetes path needs a real cluster to run; here its pod-to-endpoint logic is checked on recorded
API objects: fixtures/k8s_pod_list.json (a PodList as `GET /api/v1/namespaces/serving/pods` returns it) and
fixtures/k8s_watch_events.json (watch events), written by hand in the API's JSON shape for this test."""

import json
from pathlib import Path

from pdserve.discovery.endpoints import Endpoint, StaticDiscovery, apply_pod_event, pod_endpoint

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str):
    return json.loads((FIXTURES / name).read_text())


def pods_by_name() -> dict:
    return {pod["metadata"]["name"]: pod for pod in load("k8s_pod_list.json")["items"]}


def test_ready_running_pod_gives_url_from_its_http_port_and_role_from_its_label():
    pods = pods_by_name()
    assert pod_endpoint(pods["pdserve-prefill-0"]) == Endpoint("http://10.1.0.11:8100", "prefill")
    assert pod_endpoint(pods["pdserve-decode-0"]) == Endpoint("http://10.1.0.12:8200", "decode")


def test_ipv6_pod_address_is_bracketed():
    assert pod_endpoint(pods_by_name()["pdserve-both-0"]) == Endpoint("http://[fd00::7]:8100", "both")


def test_unready_pending_terminating_and_portless_pods_are_skipped():
    pods = pods_by_name()
    for name in ("pdserve-prefill-1", "pdserve-decode-1", "pdserve-decode-2", "pdserve-prefill-2"):
        assert pod_endpoint(pods[name]) is None, name


def test_watch_events_add_ready_pods_and_drop_unready_and_deleted_ones():
    endpoints: dict = {}
    for pod in load("k8s_pod_list.json")["items"]:
        apply_pod_event(endpoints, "ADDED", pod)
    assert sorted(e.url for e in endpoints.values()) == ["http://10.1.0.11:8100", "http://10.1.0.12:8200", "http://[fd00::7]:8100"]
    for event in load("k8s_watch_events.json"):
        apply_pod_event(endpoints, event["type"], event["object"])
    assert sorted(e.url for e in endpoints.values()) == ["http://10.1.0.13:8100", "http://10.1.0.20:8200", "http://[fd00::7]:8100"]


def test_static_discovery_lists_its_urls_without_trailing_slashes():
    discovery = StaticDiscovery(["http://127.0.0.1:1/", "http://127.0.0.1:2"])
    assert [e.url for e in discovery.endpoints()] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    discovery.close()
