"""The router's Prometheus metrics, in a registry of their own (no process-wide globals)."""

import bisect
import collections
import itertools
from collections.abc import Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pdserve.wire.kv_events import KVEvent, KVEventKind

TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Fine around 1 ms, the routing decision's goal at 256 ranks: a quantile read from the buckets interpolates inside one.
DECISION_BUCKETS_S = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.005, 0.01,
                      0.025, 0.1)
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class LoopHistogram:
    """A histogram of one series, observed and collected on the router's event loop only: an observation is a bisect
    and two additions (prometheus_client's Histogram takes ~0.7 us and two locked increments, and a request makes
    seven), and `count` equal observations take one call (the tokens of one event share one gap). Exposed as
    prometheus_client exposes its own histograms (tests/router/test_metrics.py), less the `_created` series."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation, self._labels = name, documentation, labels
        self._bounds = (*buckets, float("inf"))
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += count  # the first bucket whose bound is >= value
        self._sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        cumulative = itertools.accumulate(self._counts)
        family.add_metric(list(self._labels.values()),
                          [(floatToGoString(bound), count) for bound, count in zip(self._bounds, cumulative)],
                          sum_value=self._sum)
        yield family


class RouterMetrics:
    def __init__(self, model: str, routing_policy: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model", "routing_policy"]
        self._label_values = {"model": model, "routing_policy": routing_policy}

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> LoopHistogram:
            return LoopHistogram(name, documentation, self._label_values, buckets, self.registry)

        self.time_to_first_token = histogram("pdserve_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S)
        self.inter_token_latency = histogram("pdserve_inter_token_latency_seconds", "Time between tokens.",
                                             ITL_BUCKETS_S)
        self.e2e_request_latency = histogram("pdserve_e2e_request_latency_seconds", "Request latency.", E2E_BUCKETS_S)
        self.request_queue = histogram(
            "pdserve_request_queue_seconds", "Time from arrival to the request being sent to a worker.", QUEUE_BUCKETS_S
        )
        self.routing_decision = histogram(
            "pdserve_router_routing_decision_seconds", "Time to choose a request's prefill and decode ranks.",
            DECISION_BUCKETS_S,
        )
        # Per finished sequence (each choice of a request): what the planner sizes the pools from (pdserve/planner/).
        self.request_prompt_tokens = histogram("pdserve_request_prompt_tokens", "Prompt tokens of a finished sequence.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "pdserve_request_generation_tokens", "Tokens generated for a finished sequence.", TOKEN_BUCKETS)
        self.routed_prefix_match_ratio = histogram(
            "pdserve_routed_prefix_match_ratio", "Matched / total prompt tokens on the chosen rank.", RATIO_BUCKETS
        )
        self._requests = Counter("pdserve_requests", "Requests by final status.", labels + ["status"], registry=self.registry)
        self._ejections = Counter(
            "pdserve_router_worker_ejections", "Workers ejected after failed health checks or requests.", labels + ["worker"],
            registry=self.registry,
        )
        self._retries = Counter(
            "pdserve_router_retries", "Requests re-sent to another rank before their first token.", labels, registry=self.registry
        )
        self._migrations = Counter(
            "pdserve_router_migrations", "Streams continued on another decode path after their worker failed mid-stream.",
            labels, registry=self.registry,
        )
        self._local_prefills = Counter(
            "pdserve_router_local_prefills", "Requests prefilled on their decode rank (conditional disaggregation).",
            labels, registry=self.registry,
        )
        self._prefill_fallbacks = Counter(
            "pdserve_router_prefill_fallbacks", "Requests prefilled on their decode rank because no prefill rank could "
            "take them (none routable, or each one tried).", labels, registry=self.registry,
        )
        self._reasoning_tokens = Counter(
            "pdserve_router_reasoning_tokens", "Output tokens a thinking model spent reasoning (its <think> block, "
            "tags included), in requests whose reasoning was returned apart.", labels, registry=self.registry,
        )
        self._kv_events = Counter(
            "pdserve_router_kv_events", "KV events from prefill ranks applied to the prefix index, by kind.",
            labels + ["kind"], registry=self.registry,
        )
        self._healthy_workers = Gauge("pdserve_router_healthy_workers", "Workers routable now.", labels, registry=self.registry)

        # Children bound once: no label look-up per token, and every series is exposed (at 0) from the start.
        self._bound = {metric: metric.labels(**self._label_values) for metric in (
            self._retries, self._migrations, self._local_prefills, self._prefill_fallbacks,
            self._reasoning_tokens, self._healthy_workers)}
        self.observe_ttft = self.time_to_first_token.observe
        self.observe_itl = self.inter_token_latency.observe  # (gap, count)
        self.observe_e2e = self.e2e_request_latency.observe
        self.observe_queue = self.request_queue.observe
        self.observe_routing_decision = self.routing_decision.observe
        self.observe_prefix_match_ratio = self.routed_prefix_match_ratio.observe
        self.observe_prompt_tokens = self.request_prompt_tokens.observe
        self.observe_generation_tokens = self.request_generation_tokens.observe
        self.count_retry = self._bound[self._retries].inc
        self.count_migration = self._bound[self._migrations].inc
        self.count_local_prefill = self._bound[self._local_prefills].inc
        self.count_prefill_fallback = self._bound[self._prefill_fallbacks].inc
        self.count_reasoning_tokens = self._bound[self._reasoning_tokens].inc
        self.set_healthy_workers = self._bound[self._healthy_workers].set
        self._requests_by_status: dict[str, Counter] = {}  # bound on first use: a status may never happen
        self._kv_events_by_kind = {kind: self._kv_events.labels(kind=kind, **self._label_values)
                                   for kind in get_args(KVEventKind)}

    def count_request(self, status: str) -> None:
        counter = self._requests_by_status.get(status)
        if counter is None:
            counter = self._requests_by_status[status] = self._requests.labels(status=status, **self._label_values)
        counter.inc()

    def count_kv_events(self, events: list[KVEvent]) -> None:
        """One batch's events (a full dump holds one per cached page): one increment per kind, not per event."""
        for kind, count in collections.Counter(event.kind for event in events).items():
            self._kv_events_by_kind[kind].inc(count)

    def note_worker(self, worker_url: str) -> None:
        """A worker's ejection count exists (at 0) from its discovery on."""
        self._ejections.labels(worker=worker_url, **self._label_values)

    def count_ejection(self, worker_url: str) -> None:
        self._ejections.labels(worker=worker_url, **self._label_values).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
