"""The planner's loop: every interval, read the routers, decide, scale; one structured log line per decision."""

import json
import logging
import threading
import time
from collections.abc import Callable

import httpx

from pdserve.planner.policy import Decision, Planner, PoolSizes
from pdserve.planner.pools import Pools
from pdserve.planner.traffic import RouterCounters, Traffic, scrape_routers

log = logging.getLogger(__name__)

OnDecision = Callable[[Decision, Traffic, PoolSizes], None]


def run_planner(planner: Planner, pools: Pools, read_counters: Callable[[], RouterCounters], stop: threading.Event,
                on_decision: OnDecision | None = None) -> None:
    """Until `stop` is set. `read_counters` scrapes every router; a scrape that fails skips that decision (the
    next one spans both intervals), so a router restarting never scales a pool on no data."""
    earlier: RouterCounters | None = None
    while True:
        try:
            later = read_counters()
        except Exception as error:  # noqa: BLE001 - routers come and go; the loop must outlive them
            log.warning("reading the routers failed: %r; deciding next interval", error)
            later = None
        if earlier is not None and later is not None:
            traffic = Traffic.between(earlier, later)
            current = pools.sizes()
            decision = planner.decide(traffic, current, later.at_s)
            log.info(json.dumps({"event": "plan", "current": vars(current), "target": vars(decision.target),
                                 "rate": round(traffic.request_rate, 3), "ttft_p99_s": round(traffic.ttft_p99_s, 3),
                                 "itl_p99_s": round(traffic.itl_p99_s, 4), "reasons": decision.reasons}))
            if decision.target != current:
                pools.scale(decision.target)
            if on_decision is not None:
                on_decision(decision, traffic, current)
        earlier = later or earlier
        if stop.wait(planner.cfg.interval_s):
            return


def router_urls_now(discovery_urls: Callable[[], list[str]]) -> Callable[[], RouterCounters]:
    """A `read_counters` over whatever routers discovery names at each read."""
    http = httpx.Client(timeout=5.0)  # one client for the loop's life: a new one a read loads the CA bundle again

    def read() -> RouterCounters:
        urls = discovery_urls()
        if not urls:
            raise RuntimeError("no router found")
        return scrape_routers(http, urls, time.monotonic())

    return read
