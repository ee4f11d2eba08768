"""Where a GPU sits idle: reads a torch profiler chrome trace (`prof.export_chrome_trace`, .json or .json.gz) and
prints, per device, how much of the traced span ran kernels (copies and memsets included), the idle gaps between
them by the kernels on either side, and the host's CUDA calls that waited or launched most.

    python benchmarks/trace_gaps.py rank0.json.gz [rank1.json.gz ...] [--min-gap-us 5] [--top 12]
"""

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def short_name(name: str, width: int = 48) -> str:
    name = name.split("(")[0].replace("void ", "")
    return name if len(name) <= width else name[:width - 3] + "..."


def summarize(path: Path, min_gap_us: float = 5.0, top: int = 12) -> str:
    events = load_events(path)
    lines = [f"## {path.name}"]
    by_device: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            by_device[e.get("pid")].append(e)
    for device, device_events in sorted(by_device.items(), key=lambda item: str(item[0])):
        device_events.sort(key=lambda e: e["ts"])
        busy, idle, gaps = 0.0, 0.0, defaultdict(lambda: [0, 0.0])
        end, previous = device_events[0]["ts"], None
        for e in device_events:  # union of intervals, over every stream of the device
            start, stop = e["ts"], e["ts"] + e.get("dur", 0)
            if start > end:
                gap = start - end
                idle += gap
                if gap >= min_gap_us:
                    key = (short_name(previous["name"]) if previous else "-", short_name(e["name"]))
                    gaps[key][0] += 1
                    gaps[key][1] += gap
                busy += stop - start
            elif stop > end:
                busy += stop - end
            if stop > end:
                end, previous = stop, e
        span = end - device_events[0]["ts"]
        lines.append(f"device {device}: {len(device_events)} device events over {span / 1e3:.2f} ms: busy "
                     f"{busy / 1e3:.2f} ms ({busy / span:.0%}), idle {idle / 1e3:.2f} ms; gaps >= {min_gap_us:g} us "
                     f"{sum(n for n, _ in gaps.values())}, {sum(t for _, t in gaps.values()) / 1e3:.2f} ms")
        lines.append("| gaps | idle (ms) | mean (us) | after | before |")
        lines.append("| ---: | ---: | ---: | --- | --- |")
        for (after, before), (count, total) in sorted(gaps.items(), key=lambda item: -item[1][1])[:top]:
            lines.append(f"| {count} | {total / 1e3:.2f} | {total / count:.0f} | {after} | {before} |")
        kernel_time: dict[str, float] = defaultdict(float)
        for e in device_events:
            kernel_time[short_name(e["name"])] += e.get("dur", 0)
        lines.append("| device time (ms) | kernel |")
        lines.append("| ---: | --- |")
        for name, total in sorted(kernel_time.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"| {total / 1e3:.2f} | {name} |")
    host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            host[e["name"]][0] += 1
            host[e["name"]][1] += e.get("dur", 0)
    lines.append("| host CUDA call | calls | time (ms) |")
    lines.append("| --- | ---: | ---: |")
    for name, (count, total) in sorted(host.items(), key=lambda item: -item[1][1])[:6]:
        lines.append(f"| {name} | {count} | {total / 1e3:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.traces:
        print(summarize(path, args.min_gap_us, args.top) + "\n")


if __name__ == "__main__":
    main()
