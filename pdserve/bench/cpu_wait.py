"""What held the benchmark's processes off the CPU during a run, two ways:
- CFS quota throttling of its cgroup: a throttled cgroup runs nothing until the next period (100 ms by default), every
  process and thread in it at once, so the client's stalls have no Python frame to show and every server process in
  the same container stalls with it (a container on a GPU host may have a quota below its visible cores);
- CPU pressure (PSI, `some`): how long at least one runnable task waited for a core, from more runnable threads than
  cores (spinning progress threads, many processes on few cores)."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# cgroup v2, then v1's cpu controller mounted alone or together with cpuacct.
CPU_STAT_FILES = (Path("/sys/fs/cgroup/cpu.stat"), Path("/sys/fs/cgroup/cpu/cpu.stat"),
                  Path("/sys/fs/cgroup/cpu,cpuacct/cpu.stat"))
# The cgroup's own pressure (v2), then the machine's (or the container's, with its own cgroup namespace).
CPU_PRESSURE_FILES = (Path("/sys/fs/cgroup/cpu.pressure"), Path("/proc/pressure/cpu"))


@dataclass(frozen=True)
class Throttling:
    periods: int  # quota periods in which the cgroup ran
    throttled_periods: int  # of them, those it used up its quota in and was held off the CPU
    throttled_s: float  # how long, summed


def parse_cpu_stat(text: str) -> Throttling | None:
    """cpu.stat of cgroup v2 (throttled_usec) or v1 (throttled_time, ns); None without throttling counters."""
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            fields[name] = int(value)
    if "nr_throttled" not in fields:
        return None
    throttled_s = fields["throttled_usec"] / 1e6 if "throttled_usec" in fields else fields.get("throttled_time", 0) / 1e9
    return Throttling(fields.get("nr_periods", 0), fields["nr_throttled"], throttled_s)


def first_parsed(files: tuple[Path, ...], parse: Callable[[str], T | None]) -> T | None:
    """`parse` of the first of `files` that is readable and says something, or None."""
    for path in files:
        try:
            parsed = parse(path.read_text())
        except OSError:
            continue
        if parsed is not None:
            return parsed
    return None


def read_throttling(files: tuple[Path, ...] = CPU_STAT_FILES) -> Throttling | None:
    """This process's cgroup counters now, or None where none is readable."""
    return first_parsed(files, parse_cpu_stat)


def throttling_between(before: Throttling | None, after: Throttling | None) -> Throttling | None:
    if before is None or after is None:
        return None
    return Throttling(after.periods - before.periods, after.throttled_periods - before.throttled_periods,
                      after.throttled_s - before.throttled_s)


def parse_cpu_pressure_s(text: str) -> float | None:
    """The `some` line's cumulative `total` (microseconds) of a PSI file, in seconds."""
    for line in text.splitlines():
        kind, *fields = line.split()
        if kind == "some":
            total = dict(field.partition("=")[::2] for field in fields).get("total", "")
            return int(total) / 1e6 if total.isdigit() else None
    return None


def read_cpu_pressure_s(files: tuple[Path, ...] = CPU_PRESSURE_FILES) -> float | None:
    """Seconds, cumulative, that some runnable task waited for a CPU, or None where no file says."""
    return first_parsed(files, parse_cpu_pressure_s)
