"""How long the kernel held the benchmark's cgroup off the CPU (CFS quota throttling) during a run. A throttled cgroup
runs nothing until the next period (100 ms by default), every process and thread in it at once: the client's stalls
then have no Python frame to show, and every server process in the same container stalls with it. A container on a
GPU host may have a CPU quota below its visible cores, so a run reports what it was throttled."""

from dataclasses import dataclass
from pathlib import Path

# cgroup v2, then v1's cpu controller mounted alone or together with cpuacct.
CPU_STAT_FILES = (Path("/sys/fs/cgroup/cpu.stat"), Path("/sys/fs/cgroup/cpu/cpu.stat"),
                  Path("/sys/fs/cgroup/cpu,cpuacct/cpu.stat"))


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


def read_throttling(files: tuple[Path, ...] = CPU_STAT_FILES) -> Throttling | None:
    """This process's cgroup counters now (the first of `files` that has them), or None where none is readable."""
    for path in files:
        try:
            throttling = parse_cpu_stat(path.read_text())
        except OSError:
            continue
        if throttling is not None:
            return throttling
    return None


def throttling_between(before: Throttling | None, after: Throttling | None) -> Throttling | None:
    if before is None or after is None:
        return None
    return Throttling(after.periods - before.periods, after.throttled_periods - before.throttled_periods,
                      after.throttled_s - before.throttled_s)
