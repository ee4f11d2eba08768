"""Where the planner's decision takes effect: the pools' StatefulSets through the Kubernetes API, or a cluster on this
machine whose workers it starts and drains (pdserve/cluster/, `ClusterConfig(scalable=True)`)."""

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.planner.policy import PoolSizes

log = logging.getLogger(__name__)


class Pools(Protocol):
    def sizes(self) -> PoolSizes: ...

    def scale(self, target: PoolSizes) -> None: ...


class DryRunPools:
    """Scales nothing (the decisions are only logged); the pools are taken to be what was last decided."""

    def __init__(self, initial: PoolSizes) -> None:
        self._sizes = initial

    def sizes(self) -> PoolSizes:
        return self._sizes

    def scale(self, target: PoolSizes) -> None:
        self._sizes = target


class KubernetesPools:
    """The prefill and decode StatefulSets' scale subresource (RBAC: get and patch on statefulsets/scale); Kubernetes
    starts the pods, and on scale-down sends SIGTERM to the highest ordinals, which drain (pdserve/worker/drain.py)."""

    def __init__(self, namespace: str, prefill_statefulset: str, decode_statefulset: str,
                 api_client: Any = None) -> None:
        from kubernetes import client, config  # only this path needs a cluster's credentials

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        self._apps = client.AppsV1Api(api_client)
        self._namespace = namespace
        self._names = {"prefill": prefill_statefulset, "decode": decode_statefulset}

    def _replicas(self, pool: str) -> int:
        scale = self._apps.read_namespaced_stateful_set_scale(self._names[pool], self._namespace, _request_timeout=10)
        return scale.spec.replicas or 0

    def sizes(self) -> PoolSizes:
        return PoolSizes(self._replicas("prefill"), self._replicas("decode"))

    def scale(self, target: PoolSizes) -> None:
        for pool, replicas in (("prefill", target.prefill), ("decode", target.decode)):
            if self._replicas(pool) != replicas:
                log.info("scaling %s to %d", self._names[pool], replicas)
                self._apps.patch_namespaced_stateful_set_scale(
                    self._names[pool], self._namespace, {"spec": {"replicas": replicas}}, _request_timeout=10)


class LocalCluster(Protocol):
    """What ClusterPools needs of a cluster on this machine (InProcessCluster and LocalCluster both have it)."""

    workers: list[Any]  # each with a `name` of the form role-index

    def add_worker(self, role: str) -> Any: ...

    def remove_worker(self, worker: Any, drain_timeout_s: float = 60.0) -> bool: ...


def role_of(worker: Any) -> str:
    return worker.name.rsplit("-", 1)[0]


class ClusterPools:
    """Starts and drains a local cluster's workers towards the latest target, each start and drain on a thread of its
    own (in parallel, as Kubernetes starts a StatefulSet's pods), so none holds up the next decision. `start_delay_s`
    makes each new worker take that long before it is started (a simulated worker starts at once; a GPU worker loads
    and warms up for minutes); it counts as the worker's, like a pod that holds its GPU while it starts. `sizes()`
    counts starting workers and not draining ones."""

    def __init__(self, cluster: LocalCluster, start_delay_s: float = 0.0, drain_timeout_s: float = 60.0) -> None:
        self._cluster = cluster
        self._start_delay_s = start_delay_s
        self._drain_timeout_s = drain_timeout_s
        self._lock = threading.Condition()
        self._target: PoolSizes | None = None
        self._starting = {"prefill": 0, "decode": 0}
        self._draining: set[str] = set()
        self._stop = False
        self._changes: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._converge, name="cluster-pools", daemon=True)
        self._thread.start()

    def sizes(self) -> PoolSizes:
        with self._lock:
            return PoolSizes(self._count("prefill"), self._count("decode"))

    def starting(self) -> dict[str, int]:
        """Workers of each role waiting out their start delay or starting."""
        with self._lock:
            return dict(self._starting)

    def _count(self, role: str) -> int:
        serving = [w for w in self._cluster.workers if role_of(w) == role and w.name not in self._draining]
        return len(serving) + self._starting[role]

    def scale(self, target: PoolSizes) -> None:
        with self._lock:
            self._target = target
            self._lock.notify()

    def close(self) -> None:
        """Stop acting, and wait for the starts and drains under way."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(10)
        for change in self._changes:
            change.join(self._start_delay_s + self._drain_timeout_s + 60)

    def _converge(self) -> None:
        while True:
            with self._lock:
                while not self._stop and (self._target is None or self._target == self._current()):
                    self._lock.wait()
                if self._stop:
                    return
                change = threading.Thread(target=self._next_change(self._target), daemon=True)
                self._changes = [c for c in self._changes if c.is_alive()] + [change]
            change.start()

    def _current(self) -> PoolSizes:
        return PoolSizes(self._count("prefill"), self._count("decode"))

    def _next_change(self, target: PoolSizes) -> Callable[[], None]:
        """One worker to start or drain, in the pool furthest from its target. Called with the lock held."""
        gaps = {"prefill": target.prefill - self._count("prefill"), "decode": target.decode - self._count("decode")}
        role = max(gaps, key=lambda r: abs(gaps[r]))
        if gaps[role] > 0:
            self._starting[role] += 1
            return lambda: self._start(role)
        newest = [w for w in self._cluster.workers if role_of(w) == role and w.name not in self._draining][-1]
        self._draining.add(newest.name)
        return lambda: self._drain(newest)

    def _start(self, role: str) -> None:
        try:
            time.sleep(self._start_delay_s)
            self._cluster.add_worker(role)
        except Exception:  # logged; the pool is short of its target and the next change retries
            log.exception("starting a %s worker failed", role)
            time.sleep(1.0)
        finally:
            with self._lock:
                self._starting[role] -= 1
                self._lock.notify()

    def _drain(self, worker: Any) -> None:
        try:
            if not self._cluster.remove_worker(worker, self._drain_timeout_s):
                log.warning("%s stopped before it drained", worker.name)
        except Exception:  # logged; the worker stays in its pool and the next change retries
            log.exception("draining %s failed", worker.name)
        finally:
            with self._lock:
                self._draining.discard(worker.name)
                self._lock.notify()
