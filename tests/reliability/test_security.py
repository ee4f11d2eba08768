"""Security: API keys are enforced on every /v1 route of a real router process, with no timing difference worth
measuring between kinds of wrong key; nothing in pdserve/ or router/ deserialises with pickle (or its relatives).
The chart's RBAC (only get/list/watch on pods) is checked by
tests/helm/test_chart.py::test_router_role_allows_only_reading_pods_in_its_namespace."""

import ast
import importlib
import pkgutil
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from probes import HTTP

from pdserve.http.ports import free_port
from pdserve_router.admission import authenticate
from pdserve_router.app import build_router_app
from pdserve_router.config import RouterConfig
from pdserve_router.errors import APIError

API_KEY = "sk-pdserve-0123456789abcdef"
START_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[2]
WRONG_KEYS = {
    "missing": None,
    "wrong": "Bearer sk-x",
    "right prefix, wrong last char": "Bearer " + API_KEY[:-1] + "0",
    "right key + 1 char": "Bearer " + API_KEY + "0",
}


@pytest.fixture(scope="module")
def keyed_router(tiny_v2, tmp_path_factory):
    """A router process with API keys on and one worker URL that nothing listens on."""
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text(f"{API_KEY}\nsk-another-key\n")
    port = free_port()
    command = [sys.executable, "-m", "pdserve", "router", "--model", tiny_v2, "--workers",
               f"http://127.0.0.1:{free_port()}", "--api-keys-file", str(keys_file), "--host", "127.0.0.1",
               "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "router did not start"
            try:
                if HTTP.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=15)


def v1_routes(model_dir: str) -> list[tuple[str, str]]:
    """(method, path) of every /v1 route the router app defines, so a new route is covered without editing this."""
    app = build_router_app(RouterConfig(model_dir=model_dir))
    return sorted((method, route.path) for route in app.routes if route.path.startswith("/v1")
                  for method in getattr(route, "methods", ()) if method != "HEAD")


def call(url: str, method: str, path: str, authorization: str | None, model: str = "x") -> httpx.Response:
    headers = {"Authorization": authorization} if authorization else {}
    path = re.sub(r"\{[^}]*\}", model, path)  # path parameters (/v1/models/{model_id}) name the served model
    if "chat" in path:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    elif "responses" in path:
        body = {"model": model, "input": "hi", "max_output_tokens": 1}
    else:
        body = {"model": model, "prompt": "hi", "max_tokens": 1}
    return HTTP.request(method, url + path, headers=headers, json=body if method == "POST" else None, timeout=10)


def test_every_v1_route_needs_the_key_and_the_right_key_passes(keyed_router, tiny_v2):
    routes = v1_routes(tiny_v2)
    model = HTTP.get(keyed_router + "/v1/models", headers={"Authorization": "Bearer " + API_KEY},
                      timeout=10).json()["data"][0]["id"]
    assert {path for _, path in routes} >= {"/v1/models", "/v1/completions", "/v1/chat/completions"}
    for method, path in routes:
        for kind, authorization in WRONG_KEYS.items():
            response = call(keyed_router, method, path, authorization)
            assert response.status_code == 401, (method, path, kind, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
        right = call(keyed_router, method, path, "Bearer " + API_KEY, model)
        # Past authentication: the models list, or 503 (the only worker is unreachable), never 401.
        assert right.status_code in (200, 503), (method, path, right.text)
    assert HTTP.get(keyed_router + "/v1/models", headers={"Authorization": "Bearer sk-another-key"},
                     timeout=10).status_code == 200


def test_wrong_keys_of_every_kind_take_the_same_time(keyed_router):
    """Medians of interleaved requests (drift on a shared box hits every kind alike), over HTTP and in-process.
    The bound is loose on purpose; the figures are printed for docs/reliability.md."""
    rounds = 200
    http_s: dict[str, list[float]] = {kind: [] for kind in WRONG_KEYS}
    with httpx.Client(timeout=10) as http:
        for _ in range(rounds):
            for kind, authorization in WRONG_KEYS.items():
                headers = {"Authorization": authorization} if authorization else {}
                started = time.perf_counter()
                assert http.get(keyed_router + "/v1/models", headers=headers).status_code == 401
                http_s[kind].append(time.perf_counter() - started)

    keys = frozenset({API_KEY, "sk-another-key"})
    direct_s: dict[str, list[float]] = {kind: [] for kind in WRONG_KEYS}
    for _ in range(2000):
        for kind, authorization in WRONG_KEYS.items():
            started = time.perf_counter()
            with pytest.raises(APIError):
                authenticate(authorization, keys)
            direct_s[kind].append(time.perf_counter() - started)

    http_median = {kind: statistics.median(times) for kind, times in http_s.items()}
    direct_median = {kind: statistics.median(times) for kind, times in direct_s.items()}
    print("\n401 latency medians (HTTP round trip ms | authenticate() us):")
    for kind in WRONG_KEYS:
        print(f"  {kind:>32}: {http_median[kind] * 1e3:7.3f} ms | {direct_median[kind] * 1e6:6.2f} us")
    # A key-guessing attacker sees the HTTP figures; differences there must be below round-trip noise.
    fastest, slowest = min(http_median.values()), max(http_median.values())
    assert slowest - fastest < max(0.5e-3, 0.25 * fastest), http_median
    wrong_key_kinds = [direct_median[kind] for kind in WRONG_KEYS if kind != "missing"]
    assert max(wrong_key_kinds) - min(wrong_key_kinds) < 5e-6, direct_median


# Calls that turn bytes into objects by running code (pickle and its kin). Names as written in our sources.
UNSAFE_CALLS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "cloudpickle.load", "cloudpickle.loads", "marshal.load",
    "marshal.loads", "dill.load", "dill.loads", "joblib.load", "shelve.open", "jsonpickle.decode",
    "yaml.load", "yaml.unsafe_load", "ray.cloudpickle.loads",
}
UNSAFE_IMPORTS = {"pickle", "cloudpickle", "marshal", "dill", "shelve", "jsonpickle"}


def dotted_name(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def unsafe_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_IMPORTS]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in UNSAFE_IMPORTS or any(a.name in UNSAFE_IMPORTS for a in node.names):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = dotted_name(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if name in UNSAFE_CALLS:
                found.append(f"{name}(...) at line {node.lineno}")
            elif name.endswith("torch.load"):
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{name}(...) without weights_only=True at line {node.lineno}")
            elif name.endswith("numpy.load") or name.endswith("np.load"):
                allow = keywords.get("allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    found.append(f"{name}(allow_pickle=...) at line {node.lineno}")
    return found


def test_the_scanner_catches_what_it_looks_for():
    assert unsafe_uses("import pickle\npickle.loads(b'')") == ["import pickle", "pickle.loads(...) at line 2"]
    assert unsafe_uses("import torch\ntorch.load('f')") == ["torch.load(...) without weights_only=True at line 2"]
    assert unsafe_uses("import torch\ntorch.load('f', weights_only=True)") == []
    assert unsafe_uses("from ray import cloudpickle") and unsafe_uses("import cloudpickle")
    assert unsafe_uses("import numpy as np\nnp.load('f', allow_pickle=True)")


def test_no_module_of_pdserve_or_router_deserialises_with_pickle():
    sources: dict[str, Path] = {}
    for package_name in ("pdserve", "router"):
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            # Read, not imported: GPU-only modules (the Triton kernels) import what a CPU host lacks.
            sources[info.name] = Path(info.module_finder.find_spec(info.name).origin)
    assert len(sources) > 30 and "pdserve.ops.gemm_triton" in sources
    offenders = {name: uses for name, path in sources.items() if (uses := unsafe_uses(path.read_text()))}
    assert offenders == {}
