"""The worker's Prometheus metrics (names in dashboards/metrics.md), labelled by model, role and rank."""

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.worker.rank_config import RankStats

LABELS = ["model", "role", "rank"]
TRANSFER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    """Gauges and counters come from the ranks' latest snapshots (read at scrape time); transfer times are observed."""

    def __init__(self, model: str, role: str):
        self.model, self.role = model, role
        self.registry = CollectorRegistry()
        self._snapshots: dict[int, RankStats] = {}
        self._transfer_bytes: dict[int, int] = {}
        self._transfer_failures: dict[int, int] = {}
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds", "Time to write one request's KV pages to its decode rank",
            LABELS, buckets=TRANSFER_BUCKETS_S, registry=self.registry,
        )
        self.start_seconds = Gauge("pdserve_worker_start_seconds",
                                   "Seconds from the worker's start until the rank was ready (model load, warm-up)",
                                   LABELS, registry=self.registry)
        self.registry.register(self)

    def update(self, rank: int, stats: RankStats) -> None:
        self._snapshots[rank] = stats
        histogram = self.kv_transfer_seconds.labels(self.model, self.role, str(rank))  # exported from the start, at 0
        for seconds in stats.counters.kv_transfer_seconds:
            histogram.observe(seconds)

    def collect(self):
        gauges = {
            "pdserve_num_requests_running": ("Requests in the rank's running batch", lambda s, c: s.running),
            "pdserve_num_requests_waiting": ("Requests waiting for admission", lambda s, c: s.waiting),
            "pdserve_kv_cache_usage_ratio": (
                "Fraction of KV pages in use (prefix-cache pages count as used)",
                lambda s, c: 1.0 - s.free_pages / max(1, s.total_pages),
            ),
            "pdserve_kv_cache_pages": ("KV pages in the rank's pool, fixed at start", lambda s, c: s.total_pages),
            "pdserve_host_kv_cache_pages": ("Pages the prefix cache's host tier holds",
                                            lambda s, c: s.host_cache_pages),
            "pdserve_expert_weight_bytes": ("Routed expert weights this rank holds",
                                            lambda s, c: s.expert_weight_bytes),
            "pdserve_expert_exchange_peer_writes": (
                "1 where the decode steps' expert exchange writes into the peer GPUs' memory, 0 where it is NCCL's",
                lambda s, c: int(s.expert_peer_writes)),
        }
        counters = {
            "pdserve_prefix_cache_queries_tokens": ("Prompt tokens looked up in the prefix cache",
                                                    lambda s, c: s.prefix_queries_tokens),
            "pdserve_prefix_cache_hits_tokens": ("Prompt tokens served from the prefix cache",
                                                 lambda s, c: s.prefix_hits_tokens),
            "pdserve_host_kv_cache_offloaded_pages": ("KV pages copied from the pool into the host tier on eviction",
                                                      lambda s, c: s.host_cache_offloaded_pages),
            "pdserve_host_kv_cache_loaded_pages": ("KV pages copied back from the host tier instead of recomputed",
                                                   lambda s, c: s.host_cache_loaded_pages),
            "pdserve_prompt_tokens": ("Prompt tokens prefilled", lambda s, c: s.prompt_tokens),
            "pdserve_generation_tokens": ("Tokens generated", lambda s, c: s.generation_tokens),
            "pdserve_kv_transfer_bytes": ("KV bytes written to decode ranks", lambda s, c: c.kv_transfer_bytes),
            "pdserve_kv_transfer_failures": ("KV transfers that failed or timed out",
                                             lambda s, c: c.kv_transfer_failures),
            "pdserve_kv_transfer_descriptors": ("Byte ranges the KV writes moved (one per run of pages)",
                                                lambda s, c: c.kv_transfer_descriptors),
            "pdserve_kv_transfer_posting_seconds": (
                "Seconds of the KV writes' time before NIXL had them (other threads' posts and the "
                "descriptors' making), summed", lambda s, c: c.kv_transfer_posting_seconds),
            "pdserve_kv_transfer_queued_seconds": (
                "Of the KV writes' time before NIXL had them, the wait for another thread's post, summed",
                lambda s, c: c.kv_transfer_queued_seconds),
            "pdserve_kv_transfer_post_call_seconds": ("Seconds in NIXL's post call of the KV writes, summed",
                                                      lambda s, c: c.kv_transfer_post_call_seconds),
            "pdserve_kv_reservations_refused": ("Reservation queries refused (unknown request, wrong token, twice)",
                                                lambda s, c: c.reservations_refused),
            "pdserve_kv_notifications_rejected": ("KV notifications for no reservation awaiting one",
                                                  lambda s, c: c.notifications_rejected),
            "pdserve_expert_exchange_overflow_steps": (
                "Fixed-capacity expert-parallel decode steps run again with split sizes (some rank overflowed)",
                lambda s, c: s.expert_exchange_overflows),
            "pdserve_expert_replica_slots_filled": (
                "Replica slots of hot experts that the instance's rebalances filled with a new expert (all ranks)",
                lambda s, c: s.expert_replica_slots_filled),
        }
        for name, (doc, read) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for rank, rank_stats in sorted(self._snapshots.items()):
                family.add_metric([self.model, self.role, str(rank)], read(rank_stats.engine, rank_stats.counters))
            yield family
        for name, (doc, read) in counters.items():
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for rank, rank_stats in sorted(self._snapshots.items()):
                family.add_metric([self.model, self.role, str(rank)], read(rank_stats.engine, rank_stats.counters))
            yield family
        family = CounterMetricFamily("pdserve_expert_tokens", "Routed (token, expert) pairs sent to each expert, "
                                     "summed over MoE layers", labels=[*LABELS, "expert"])
        for rank, rank_stats in sorted(self._snapshots.items()):
            for expert, pairs in enumerate(rank_stats.engine.expert_tokens):
                family.add_metric([self.model, self.role, str(rank), str(expert)], pairs)
        yield family
