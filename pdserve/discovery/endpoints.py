"""Where the workers are: a snapshot of endpoints behind one interface, from a static list, a file that changes, or
Kubernetes pods."""

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

ROLE_LABEL = "pdserve.io/role"
PORT_NAME = "http"


@dataclass(frozen=True)
class Endpoint:
    url: str
    role: str | None = None  # prefill|decode|both when discovery knows it; the worker's info says it anyway


class Discovery(Protocol):
    def endpoints(self) -> list[Endpoint]: ...

    def close(self) -> None: ...


class StaticDiscovery:
    def __init__(self, urls: list[str] | tuple[str, ...]) -> None:
        self._endpoints = [Endpoint(url=url.rstrip("/")) for url in urls]

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    def close(self) -> None:
        pass


class FileDiscovery:
    """Worker URLs in a file, one per line (`#` starts a comment), read again whenever the file changes: how a
    cluster on one machine grows and shrinks its pools (pdserve/cluster/, the planner). Whoever writes the file
    replaces it whole (write, then rename), so a reader never sees half of it."""

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("file discovery needs a file (--workers-file, --peers-file)")
        self._path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None  # (mtime_ns, inode) of the version read
        self._endpoints: list[Endpoint] = []

    def endpoints(self) -> list[Endpoint]:
        try:
            stat = os.stat(self._path)
        except FileNotFoundError:  # not written yet, or removed: no workers
            return []
        with self._lock:
            if self._seen != (stat.st_mtime_ns, stat.st_ino):
                with open(self._path) as file:
                    lines = [line.split("#", 1)[0].strip() for line in file]
                self._endpoints = [Endpoint(url=line.rstrip("/")) for line in lines if line]
                self._seen = (stat.st_mtime_ns, stat.st_ino)
            return list(self._endpoints)

    def close(self) -> None:
        pass


def write_endpoints_file(path: str, urls: list[str]) -> None:
    """Replace the file FileDiscovery reads in one rename."""
    descriptor, partial = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".endpoints-")
    with os.fdopen(descriptor, "w") as file:
        file.write("".join(f"{url}\n" for url in urls))
    os.replace(partial, path)


def pod_endpoint(pod: dict[str, Any]) -> Endpoint | None:
    """The endpoint of a pod as the API returns it (JSON), or None unless it is Ready, has an IP and an `http` port."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    conditions = status.get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return None
    pod_ip = status.get("podIP")
    if not pod_ip:
        return None
    port = None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for container_port in container.get("ports") or []:
            if container_port.get("name") == PORT_NAME:
                port = container_port.get("containerPort")
                break
        if port is not None:
            break
    if port is None:
        return None
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    role = (metadata.get("labels") or {}).get(ROLE_LABEL)
    return Endpoint(url=f"http://{host}:{port}", role=role)


def apply_pod_event(endpoints_by_pod: dict[str, Endpoint], event_type: str, pod: dict[str, Any]) -> None:
    """Update the pod-name -> endpoint map with one watch event (ADDED, MODIFIED, DELETED)."""
    metadata = pod.get("metadata") or {}
    key = f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
    endpoint = None if event_type == "DELETED" else pod_endpoint(pod)
    if endpoint is None:
        endpoints_by_pod.pop(key, None)
    else:
        endpoints_by_pod[key] = endpoint


class KubernetesDiscovery:
    """Watches pods matching a label selector in one namespace; list, then watch from the list's resourceVersion,
    and list again when the watch expires (410 Gone) or breaks. Needs RBAC: get/list/watch on pods."""

    def __init__(self, namespace: str, label_selector: str, watch_timeout_s: int = 60) -> None:
        from kubernetes import client, config  # imported here: only the k8s path needs a cluster config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self._api = client.CoreV1Api()
        self._namespace = namespace
        self._label_selector = label_selector
        self._watch_timeout_s = watch_timeout_s
        self._lock = threading.Lock()
        self._endpoints_by_pod: dict[str, Endpoint] = {}
        self._stop = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)
        self._thread.start()

    def endpoints(self) -> list[Endpoint]:
        with self._lock:
            return sorted(self._endpoints_by_pod.values(), key=lambda e: e.url)

    def close(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=5)

    def _list(self) -> str:
        pods = self._api.list_namespaced_pod(self._namespace, label_selector=self._label_selector, _request_timeout=30)
        raw = self._api.api_client.sanitize_for_serialization(pods)
        fresh: dict[str, Endpoint] = {}
        for pod in raw.get("items") or []:
            apply_pod_event(fresh, "ADDED", pod)
        with self._lock:
            self._endpoints_by_pod = fresh
        return raw["metadata"].get("resourceVersion", "")

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        resource_version = ""
        while not self._stop.is_set():
            try:
                if not resource_version:
                    resource_version = self._list()
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    self._api.list_namespaced_pod,
                    self._namespace,
                    label_selector=self._label_selector,
                    resource_version=resource_version,
                    timeout_seconds=self._watch_timeout_s,
                ):
                    if self._stop.is_set():
                        return
                    pod = event["raw_object"]
                    if event["type"] == "BOOKMARK":
                        continue
                    if event["type"] == "ERROR":
                        resource_version = ""  # 410 Gone and friends: list again
                        break
                    with self._lock:
                        apply_pod_event(self._endpoints_by_pod, event["type"], pod)
                    resource_version = (pod.get("metadata") or {}).get("resourceVersion", resource_version)
            except ApiException as error:
                logger.warning("kubernetes watch failed (%s); listing again", error.status)
                resource_version = ""
                self._stop.wait(1.0)
            except Exception:  # the watch must outlive network blips; log and retry, bounded by the stop wait
                logger.exception("kubernetes discovery error; retrying")
                resource_version = ""
                self._stop.wait(1.0)
