"""Turns per-request results into the benchmark's summary: latency percentiles, throughput, goodput under an SLO,
prefix-cache hit ratio; writes it as JSON and compares two results in one table."""

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.client import RequestResult
from pdserve.bench.cpu_wait import Throttling
from pdserve.bench.loop_watch import LoopStall

PERCENTILES = (50, 90, 99)
LONGEST_STALLS_KEPT = 10


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # a request meets the SLO when its TTFT is at most this ...
    itl_p99_s: float  # ... and the p99 of its own inter-token gaps at most this


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower, upper = math.floor(position), math.ceil(position)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def distribution(values: list[float]) -> dict[str, float | None]:
    summary: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    summary["mean"] = sum(values) / len(values) if values else None
    return summary


def meets_slo(result: RequestResult, slo: SLO) -> bool:
    if not result.ok or result.ttft_s is None or result.ttft_s > slo.ttft_s:
        return False
    own_itl_p99 = percentile(result.itl_s, 99)
    return own_itl_p99 is None or own_itl_p99 <= slo.itl_p99_s


def summarize(results: list[RequestResult], duration_s: float, slo: SLO, prefix_cache_hit_ratio: float | None = None,
              client_stalls: Sequence[LoopStall] = (), cpu_throttling: Throttling | None = None,
              cpu_pressure_s: float | None = None) -> dict:
    """The summary fields of a result JSON (see docs/benchmarks.md); latencies in seconds. `client_stalls`: the
    client's own event-loop stalls (pdserve/bench/loop_watch.py), the longest kept with their stacks.
    `cpu_throttling`, `cpu_pressure_s`: the run's CFS throttling of the client's cgroup and the time some runnable task
    waited for a CPU (pdserve/bench/cpu_wait.py), None where unknown."""
    completed = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in completed if r.ttft_s is not None]
    itls = [gap for r in completed for gap in r.itl_s]
    e2es = [r.e2e_s for r in completed if r.e2e_s is not None]
    output_tokens = sum(r.output_tokens for r in completed)
    prompt_tokens = sum(r.prompt_tokens for r in completed)
    met = sum(meets_slo(r, slo) for r in results)
    return {
        "num_requests": len(results),
        "completed": len(completed),
        "failed": len(results) - len(completed),
        "duration_s": duration_s,
        "requests_per_s": len(completed) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_s": distribution(ttfts),
        "itl_s": distribution(itls),
        "e2e_s": distribution(e2es),
        "slo": asdict(slo),
        "slo_met_requests": met,
        "goodput_requests_per_s": met / duration_s if duration_s > 0 else 0.0,
        "prefix_cache_hit_ratio": prefix_cache_hit_ratio,
        "reported_cached_prompt_ratio": (sum(r.cached_tokens for r in completed) / prompt_tokens
                                         if prompt_tokens else None),
        "client_stalls": len(client_stalls),
        "client_stall_s": sum(stall.duration_s for stall in client_stalls),
        "longest_client_stalls": [asdict(stall) for stall in
                                  sorted(client_stalls, key=lambda stall: -stall.duration_s)[:LONGEST_STALLS_KEPT]],
        "cpu_throttling": asdict(cpu_throttling) if cpu_throttling is not None else None,
        "cpu_pressure_s": cpu_pressure_s,
    }


def within_slo(summary: dict, slo: SLO) -> bool:
    """The run as a whole meets the SLO: nothing failed, TTFT p99 and ITL p99 over all requests within bounds."""
    ttft_p99, itl_p99 = summary["ttft_s"]["p99"], summary["itl_s"]["p99"]
    return (summary["failed"] == 0 and ttft_p99 is not None and ttft_p99 <= slo.ttft_s
            and (itl_p99 is None or itl_p99 <= slo.itl_p99_s))


def write_json(path: str | Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


COMPARED_ROWS = (
    ("requests/s", ("requests_per_s",), 1.0),
    ("output tokens/s", ("output_tokens_per_s",), 1.0),
    ("goodput req/s", ("goodput_requests_per_s",), 1.0),
    ("TTFT p50 (ms)", ("ttft_s", "p50"), 1e3), ("TTFT p90 (ms)", ("ttft_s", "p90"), 1e3),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), 1e3),
    ("ITL p50 (ms)", ("itl_s", "p50"), 1e3), ("ITL p90 (ms)", ("itl_s", "p90"), 1e3),
    ("ITL p99 (ms)", ("itl_s", "p99"), 1e3),
    ("E2E p50 (ms)", ("e2e_s", "p50"), 1e3), ("E2E p99 (ms)", ("e2e_s", "p99"), 1e3),
    ("prefix hit ratio", ("prefix_cache_hit_ratio",), 1.0),
    ("failed", ("failed",), 1.0),
)


def _lookup(summary: dict, path: tuple[str, ...]) -> float | None:
    value = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def compare_table(left: dict, right: dict, left_name: str = "A", right_name: str = "B") -> str:
    """A Markdown table of two results' summaries, with right/left ratios."""
    lines = [f"| metric | {left_name} | {right_name} | {right_name}/{left_name} |", "| --- | ---: | ---: | ---: |"]
    for label, path, scale in COMPARED_ROWS:
        a, b = _lookup(left["summary"], path), _lookup(right["summary"], path)
        ratio = f"{b / a:.2f}" if a and b is not None else "-"
        lines.append(f"| {label} | {_fmt(a, scale)} | {_fmt(b, scale)} | {ratio} |")
    return "\n".join(lines)


def _fmt(value: float | None, scale: float) -> str:
    return "-" if value is None else f"{value * scale:.3g}" if scale != 1.0 else f"{value:.4g}"


def summary_lines(summary: dict) -> str:
    def ms(d: dict) -> str:
        return " / ".join("-" if d[f"p{q}"] is None else f"{d[f'p{q}'] * 1e3:.1f}" for q in PERCENTILES)
    hit = summary["prefix_cache_hit_ratio"]
    return "\n".join([
        f"requests: {summary['completed']}/{summary['num_requests']} ok in {summary['duration_s']:.1f} s "
        f"({summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tok/s)",
        f"TTFT p50/p90/p99 ms: {ms(summary['ttft_s'])}",
        f"ITL  p50/p90/p99 ms: {ms(summary['itl_s'])}",
        f"E2E  p50/p90/p99 ms: {ms(summary['e2e_s'])}",
        f"goodput: {summary['goodput_requests_per_s']:.2f} req/s ({summary['slo_met_requests']} met TTFT <= "
        f"{summary['slo']['ttft_s']} s and own ITL p99 <= {summary['slo']['itl_p99_s']} s)",
        f"prefix-cache hit ratio (prefill side): {'-' if hit is None else f'{hit:.3f}'}",
        f"client event-loop stalls over 50 ms: {stalls_text(summary)}",
        f"CPU quota (the client's cgroup): {throttling_text(summary.get('cpu_throttling'))}; "
        f"a runnable task waited for a CPU: {pressure_text(summary)}",
    ])


def throttling_text(throttling: dict | None) -> str:
    if throttling is None:
        return "not readable"
    return (f"throttled in {throttling['throttled_periods']} of {throttling['periods']} periods, "
            f"{throttling['throttled_s'] * 1e3:.0f} ms in all")


def pressure_text(summary: dict) -> str:
    pressure_s = summary.get("cpu_pressure_s")
    if pressure_s is None:
        return "not readable"
    return f"{pressure_s:.1f} s of the run's {summary['duration_s']:.1f} s"


def stalls_text(summary: dict) -> str:
    """The load generator's stalls: gaps it recorded across them are its own (summaries written before it had them
    read as none)."""
    longest = summary.get("longest_client_stalls") or []
    if not longest:
        return "none"
    return (f"{summary['client_stalls']} ({summary['client_stall_s'] * 1e3:.0f} ms in all), longest "
            f"{longest[0]['duration_s'] * 1e3:.0f} ms at {longest[0]['start_s']:.1f} s (garbage collection "
            f"{longest[0]['gc_s'] * 1e3:.0f} ms of it)")
