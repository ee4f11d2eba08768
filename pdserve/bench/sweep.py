"""Request-rate sweep: the highest Poisson rate at which a deployment still meets the SLO.

Doubles the rate from a start until a run misses the SLO, then bisects between the last passing and the first
failing rate; every run replays the same seeded workload at its own rate. The number of runs is bounded.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.bench.report import SLO, within_slo
from pdserve.bench.workload import WorkloadConfig


@dataclass(frozen=True)
class SweepConfig:
    start_rate: float = 1.0
    max_runs: int = 8
    bisect_tolerance: float = 0.1  # stop bisecting when (fail - pass) / pass is below this
    rates: tuple[float, ...] = ()  # fixed rates to run instead of searching


RunAtRate = Callable[[WorkloadConfig], dict]  # runs a workload, returns a result with a "summary"


def sweep_rates(run: RunAtRate, workload: WorkloadConfig, slo: SLO, cfg: SweepConfig) -> dict:
    points: list[dict] = []

    def measure(rate: float) -> bool:
        result = run(replace(workload, request_rate=rate))
        passed = within_slo(result["summary"], slo)
        points.append({"request_rate": rate, "meets_slo": passed, "summary": result["summary"], "result": result})
        return passed

    if cfg.rates:
        for rate in cfg.rates[: cfg.max_runs]:
            measure(rate)
    else:
        passing, failing, rate = None, None, cfg.start_rate
        while len(points) < cfg.max_runs and failing is None:
            if measure(rate):
                passing, rate = rate, rate * 2
            else:
                failing = rate
        if passing is None and failing is not None:  # even the start rate fails: halve down instead
            rate = failing / 2
            while len(points) < cfg.max_runs and passing is None:
                if measure(rate):
                    passing = rate
                else:
                    failing, rate = rate, rate / 2
        while (len(points) < cfg.max_runs and passing is not None and failing is not None
               and (failing - passing) / passing > cfg.bisect_tolerance):
            middle = (passing + failing) / 2
            if measure(middle):
                passing = middle
            else:
                failing = middle
    best = max((p["request_rate"] for p in points if p["meets_slo"]), default=None)
    return {"slo": {"ttft_s": slo.ttft_s, "itl_p99_s": slo.itl_p99_s}, "best_rate_meeting_slo": best,
            "points": sorted(points, key=lambda p: p["request_rate"])}
