"""What the planner observes: the routers' request counters and latency histograms, scraped from their /metrics and
summed over every router, and the traffic between two such scrapes (rate, mean lengths, latency quantiles)."""

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), as a Prometheus histogram holds them

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
PROMPT_TOKENS = "pdserve_request_prompt_tokens"
GENERATION_TOKENS = "pdserve_request_generation_tokens"


def histogram_buckets(metrics_text: str, name: str) -> Buckets:
    """(upper bound, cumulative count) of one histogram, summed over its label sets."""
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return tuple(sorted(counts.items()))


def histogram_quantile(buckets: Buckets, q: float) -> float:
    """As Prometheus's histogram_quantile: linear within the bucket that holds the q-th observation."""
    total = buckets[-1][1] if buckets else 0.0
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = bound, cumulative
    return lower


def metric_sums(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each named sample (e.g. `..._count`, `..._sum`) summed over its label sets."""
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


@dataclass(frozen=True)
class RouterCounters:
    """One scrape of every router, summed: requests finished, their prompt and generated tokens, latency buckets."""

    at_s: float
    requests: float
    prompt_tokens: float
    generation_tokens: float
    ttft: Buckets
    itl: Buckets

    @classmethod
    def parse(cls, at_s: float, metrics_texts: list[str]) -> "RouterCounters":
        names = (f"{PROMPT_TOKENS}_count", f"{PROMPT_TOKENS}_sum", f"{GENERATION_TOKENS}_sum")
        sums = dict.fromkeys(names, 0.0)
        ttft: dict[float, float] = {}
        itl: dict[float, float] = {}
        for text in metrics_texts:
            for name, value in metric_sums(text, names).items():
                sums[name] += value
            for merged, histogram in ((ttft, TTFT), (itl, ITL)):
                for bound, count in histogram_buckets(text, histogram):
                    merged[bound] = merged.get(bound, 0.0) + count
        return cls(at_s, sums[names[0]], sums[names[1]], sums[names[2]], tuple(sorted(ttft.items())),
                   tuple(sorted(itl.items())))


def scrape_routers(http: httpx.Client, urls: list[str], at_s: float) -> RouterCounters:
    """Every router's /metrics, summed (the planner sees the whole front door, however many routers it has)."""
    texts = [http.get(url.rstrip("/") + "/metrics").text for url in urls]
    return RouterCounters.parse(at_s, texts)


def bucket_delta(later: Buckets, earlier: Buckets) -> Buckets:
    before = dict(earlier)
    return tuple((bound, count - before.get(bound, 0.0)) for bound, count in later)


@dataclass(frozen=True)
class Traffic:
    """The traffic between two scrapes: its rate from the requests that got their first token (a request is counted
    about a TTFT after it arrived, not a whole generation later, so a burst shows within one interval), its lengths
    and latencies from the requests that finished."""

    duration_s: float
    request_rate: float  # requests per second that got their first token
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_p99_s: float
    itl_p99_s: float

    @classmethod
    def between(cls, earlier: RouterCounters, later: RouterCounters) -> "Traffic":
        """A router that restarted between the scrapes counts from 0 again: a negative difference reads as none."""
        duration_s = max(later.at_s - earlier.at_s, 1e-9)
        requests = max(later.requests - earlier.requests, 0.0)
        prompt = max(later.prompt_tokens - earlier.prompt_tokens, 0.0)
        generated = max(later.generation_tokens - earlier.generation_tokens, 0.0)
        ttft, itl = bucket_delta(later.ttft, earlier.ttft), bucket_delta(later.itl, earlier.itl)
        started = max(ttft[-1][1], 0.0) if ttft else 0.0  # the +Inf bucket: every first token observed
        return cls(duration_s, started / duration_s, prompt / requests if requests else 0.0,
                   generated / requests if requests else 0.0,
                   histogram_quantile(ttft, 0.99) if started else 0.0,
                   histogram_quantile(itl, 0.99) if itl and itl[-1][1] > 0 else 0.0)
