"""PNG plots of benchmark results: latency CDFs of one or more runs, and goodput against request rate."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

CDF_PANELS = (("ttft_s", "TTFT (ms)"), ("itl_s", "ITL (ms)"), ("e2e_s", "end-to-end latency (ms)"))


def _per_request_values(result: dict, key: str) -> list[float]:
    records = [r for r in result["requests"] if r["ok"]]
    if key == "itl_s":
        return sorted(gap * 1e3 for r in records for gap in r["itl_s"])
    return sorted(r[key] * 1e3 for r in records if r[key] is not None)


def plot_latency_cdfs(results: list[dict], path: str | Path) -> None:
    figure, axes = plt.subplots(1, len(CDF_PANELS), figsize=(5 * len(CDF_PANELS), 4))
    for axis, (key, title) in zip(axes, CDF_PANELS):
        for result in results:
            values = _per_request_values(result, key)
            if values:
                axis.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                          label=result.get("label") or result["url"])
        axis.set_xlabel(title)
        axis.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of token gaps")
        axis.set_xscale("log")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_goodput_vs_rate(sweeps: dict[str, list[dict]], path: str | Path) -> None:
    """sweeps: deployment name -> its sweep points ({"request_rate", "summary"})."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, points in sweeps.items():
        points = sorted(points, key=lambda p: p["request_rate"])
        axis.plot([p["request_rate"] for p in points], [p["summary"]["goodput_requests_per_s"] for p in points],
                  marker="o", label=name)
    axis.set_xlabel("request rate (req/s)")
    axis.set_ylabel("goodput (req/s meeting the SLO)")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
