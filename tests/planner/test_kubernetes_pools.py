"""The planner scales the pools' StatefulSets through the Kubernetes API with the real kubernetes client.

No Kubernetes API server can run on this machine, so the client talks to a stand-in: a small HTTP server speaking the
two calls the planner makes (GET and PATCH of apps/v1 statefulsets/{name}/scale) as the API server answers them,
bearer token included. It is a stand-in for what cannot run here, not for pdserve code."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from pdserve.planner.policy import PoolSizes
from pdserve.planner.pools import KubernetesPools

TOKEN = "stand-in-service-account-token"
SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/statefulsets/([^/]+)/scale$")


class StandInApiServer(ThreadingHTTPServer):
    def __init__(self, replicas: dict[tuple[str, str], int]):
        super().__init__(("127.0.0.1", 0), ScaleHandler)
        self.replicas = replicas
        self.patches: list[tuple[str, str, str, dict]] = []  # namespace, name, content type, body

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ScaleHandler(BaseHTTPRequestHandler):
    server: StandInApiServer

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self) -> tuple[str, str] | None:
        if self.headers.get("authorization") != f"Bearer {TOKEN}":
            self._answer(401, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Unauthorized",
                               "code": 401})
            return None
        match = SCALE_PATH.match(self.path.split("?", 1)[0])
        if match is None or match.groups() not in self.server.replicas:
            self._answer(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                               "code": 404})
            return None
        return match.group(1), match.group(2)

    def _scale_body(self, key: tuple[str, str]) -> dict:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": key[1], "namespace": key[0]},
                "spec": {"replicas": self.server.replicas[key]}, "status": {"replicas": self.server.replicas[key]}}

    def do_GET(self) -> None:
        key = self._scale()
        if key is not None:
            self._answer(200, self._scale_body(key))

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        key = self._scale()
        if key is not None:
            self.server.patches.append((*key, self.headers.get("content-type"), body))
            self.server.replicas[key] = body["spec"]["replicas"]
            self._answer(200, self._scale_body(key))


@pytest.fixture
def api_server():
    server = StandInApiServer({("serving", "pd-prefill"): 1, ("serving", "pd-decode"): 2})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join(10)


def api_client(url: str, token: str) -> client.ApiClient:
    configuration = client.Configuration(host=url, api_key={"authorization": token},
                                         api_key_prefix={"authorization": "Bearer"})
    return client.ApiClient(configuration)


def test_the_planner_reads_and_scales_the_statefulsets_and_leaves_alone_what_is_on_target(api_server):
    pools = KubernetesPools("serving", "pd-prefill", "pd-decode", api_client(api_server.url, TOKEN))
    assert pools.sizes() == PoolSizes(1, 2)
    pools.scale(PoolSizes(3, 2))
    assert api_server.replicas == {("serving", "pd-prefill"): 3, ("serving", "pd-decode"): 2}
    assert [(ns, name, body) for ns, name, _, body in api_server.patches] == [
        ("serving", "pd-prefill", {"spec": {"replicas": 3}})]  # the decode pool was on target: no call
    assert "patch" in api_server.patches[0][2]  # a merge or strategic-merge patch, not a replace
    assert pools.sizes() == PoolSizes(3, 2)


def test_without_the_credential_nothing_is_scaled(api_server):
    pools = KubernetesPools("serving", "pd-prefill", "pd-decode", api_client(api_server.url, "stolen-or-none"))
    with pytest.raises(ApiException) as refused:
        pools.scale(PoolSizes(5, 5))
    assert refused.value.status == 401
    assert api_server.patches == [] and api_server.replicas[("serving", "pd-prefill")] == 1


def test_a_statefulset_that_does_not_exist_is_an_error_not_a_silent_success(api_server):
    pools = KubernetesPools("serving", "pd-prefill", "no-such-pool", api_client(api_server.url, TOKEN))
    with pytest.raises(ApiException) as missing:
        pools.sizes()
    assert missing.value.status == 404
