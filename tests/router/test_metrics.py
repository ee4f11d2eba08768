"""The router's histograms take a repeated observation in one call and expose what prometheus_client's own
Histogram exposes for the same observations made one by one (buckets, count, sum)."""

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve_router.metrics import ITL_BUCKETS_S, LoopHistogram


def samples(registry: CollectorRegistry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if not s.name.endswith("_created")}


def test_loop_histograms_expose_what_prometheus_clients_histograms_do_for_the_same_observations():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    labels = {"model": "m", "routing_policy": "prefix"}
    repeated = LoopHistogram("itl_seconds", "gaps", labels, ITL_BUCKETS_S, ours)
    one_by_one = Histogram("itl_seconds", "gaps", list(labels), buckets=ITL_BUCKETS_S, registry=theirs).labels(**labels)
    rng = random.Random(3)
    # Gaps on bucket bounds (le is inclusive), between them, past the last, and zero-count calls.
    gaps = [0.0, 0.001, 0.0025, 0.05, 5.0, 7.5, 0.0333] + [rng.uniform(0, 0.2) for _ in range(50)]
    for gap in gaps:
        count = rng.choice([0, 1, 3, 64])
        repeated.observe(gap, count)
        for _ in range(count):
            one_by_one.observe(gap)
    expected = samples(theirs)
    assert expected[("itl_seconds_count", tuple(sorted(labels.items())))] > 0
    assert samples(ours).keys() == expected.keys()
    for key, value in samples(ours).items():
        assert abs(value - expected[key]) <= 1e-9 * max(1.0, abs(expected[key])), key
