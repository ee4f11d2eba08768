"""The workers' prefix-cache counters, read from their /metrics; the router's /health names the workers."""

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUERIES = "pdserve_prefix_cache_queries_tokens"
HITS = "pdserve_prefix_cache_hits_tokens"


@dataclass(frozen=True)
class PrefixCounters:
    queries_tokens: float
    hits_tokens: float


RankKey = tuple[str, str, str]  # worker url, role, rank


def worker_urls(router_url: str, timeout_s: float = 5.0) -> list[str]:
    response = httpx.get(router_url + "/health", timeout=timeout_s)
    response.raise_for_status()
    return sorted(response.json().get("workers", {}))


def scrape_prefix_counters(urls: list[str], timeout_s: float = 5.0) -> dict[RankKey, PrefixCounters]:
    """Per (worker, role, rank) counters; a worker that does not answer is left out."""
    values: dict[RankKey, dict[str, float]] = {}
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=timeout_s).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            if family.name not in (QUERIES, HITS):
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (url, sample.labels.get("role", ""), sample.labels.get("rank", ""))
                    values.setdefault(key, {})[family.name] = sample.value
    return {key: PrefixCounters(found.get(QUERIES, 0.0), found.get(HITS, 0.0)) for key, found in values.items()}


def hit_ratio_between(before: dict[RankKey, PrefixCounters], after: dict[RankKey, PrefixCounters],
                      roles: tuple[str, ...] = ("prefill", "both")) -> tuple[float | None, dict[str, dict[str, float]]]:
    """Hit tokens over query tokens added between two scrapes, over the ranks of the given roles (the prefill side:
    decode ranks receive their KV and never query), and the per-rank deltas keyed 'url role rank'."""
    per_rank: dict[str, dict[str, float]] = {}
    hits = queries = 0.0
    for key, end in sorted(after.items()):
        start = before.get(key, PrefixCounters(0.0, 0.0))
        delta_queries, delta_hits = end.queries_tokens - start.queries_tokens, end.hits_tokens - start.hits_tokens
        per_rank[" ".join(key)] = {"queries_tokens": delta_queries, "hits_tokens": delta_hits}
        if key[1] in roles:
            hits, queries = hits + delta_hits, queries + delta_queries
    return (hits / queries if queries else None), per_rank
