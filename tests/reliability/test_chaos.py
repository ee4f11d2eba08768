"""Chaos under load (benchmarks/chaos.py): SIGKILL in turn a prefill worker, a decode worker, one rank of a 2-rank
worker and the router, restarting each, while the soak load runs: no request hangs, none is lost (every one ends
with a response or a clear error), and throughput comes back. Minutes long: marked slow, out of CI."""

import pytest

from benchmarks.chaos import ChaosConfig, chaos_cluster_config, format_table, run_chaos
from pdserve.cluster.local import LocalCluster


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_killing_each_part_under_load_hangs_and_loses_no_request(tiny_v2, tmp_path):
    with LocalCluster(chaos_cluster_config(tiny_v2, str(tmp_path))) as cluster:
        results = run_chaos(cluster, ChaosConfig())
    print("\n" + format_table(results))
    for result in results:
        assert result.report.hung == 0 and result.report.lost == [], (result.fault, result.report.lost[:3])
        assert result.report.completed > 0 and result.recover_s is not None, result.fault
        if result.fault != "router":  # only a router death cuts connections
            assert result.report.cut == [], (result.fault, result.report.cut[:3])
        if result.fault == "one rank of a 2-rank worker":
            assert "worker reported unhealthy" in result.notes
