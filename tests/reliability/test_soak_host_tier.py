"""Soak with the prefix cache's host tier: concurrent mixed streams through a real router and prefill/decode workers
whose pools are small (64 pages), so pages keep moving to host memory while requests run, are preempted and hand
off: 0 errors, 0 hung requests, every pool back to rest."""

import asyncio

from load import run_load
from probes import eventually, metric_total
from stream_calls import model_of, pages_at_rest

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

REQUEST_TIMEOUT_S = 120.0


def test_soak_8s_8_streams_through_small_pools_and_the_host_tier(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1,
                        worker_args=("--dtype", "float32", "--num-pages", "64", "--host-kv-cache-gib", "0.1"))
    with InProcessCluster(cfg) as cluster:
        report = asyncio.run(asyncio.wait_for(
            run_load(cluster.url, model_of(cluster.url), 8, 8.0, REQUEST_TIMEOUT_S), 8.0 + 2 * REQUEST_TIMEOUT_S))
        host = {name: sum(metric_total(w.url, f"pdserve_host_kv_cache_{name}_pages_total") for w in cluster.workers)
                for name in ("offloaded", "loaded")}
        print(f"\nsoak: {report.completed} requests, errors {len(report.errors)}, hung {report.hung}; host tier: "
              f"{host['offloaded']:.0f} pages offloaded, {host['loaded']:.0f} loaded back")
        assert report.errors == [] and report.cut == [] and report.lost == [] and report.hung == 0, \
            (report.errors + report.cut + report.lost)[:5]
        # loads are a handful a run (the shared "soak" prefix stays hot on the device): counted, not required;
        # tests/router/test_host_kv_tier_routing.py makes them happen on purpose
        assert report.completed >= 8 and host["offloaded"] > 0
        for worker in cluster.workers:
            assert eventually(lambda w=worker: pages_at_rest(w.url), timeout_s=30), f"{worker.name} holds pages"
