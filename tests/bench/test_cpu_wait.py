"""What a run reports of its processes held off the CPU: CFS throttling from cgroup v2's and v1's cpu.stat, CPU
pressure from a PSI file."""

from pdserve.bench.cpu_wait import (
    Throttling,
    parse_cpu_pressure_s,
    parse_cpu_stat,
    read_cpu_pressure_s,
    read_throttling,
    throttling_between,
)
from pdserve.bench.report import SLO, summarize, summary_lines

V2 = """usage_usec 8104367
user_usec 6403911
system_usec 1700456
nr_periods 1200
nr_throttled 37
throttled_usec 2950000
nr_bursts 0
burst_usec 0
"""
V1 = """nr_periods 500
nr_throttled 4
throttled_time 310000000
nr_bursts 0
burst_time 0
"""


def test_both_cgroup_versions_parse_to_periods_and_seconds():
    assert parse_cpu_stat(V2) == Throttling(1200, 37, 2.95)
    assert parse_cpu_stat(V1) == Throttling(500, 4, 0.31)
    assert parse_cpu_stat("usage_usec 12\n") is None  # a cpu.stat without the cpu controller's counters


def test_the_first_readable_file_is_read_and_a_run_is_the_difference(tmp_path):
    missing, empty, v1 = tmp_path / "none", tmp_path / "empty.stat", tmp_path / "v1.stat"
    empty.write_text("usage_usec 5\n")
    v1.write_text(V1)
    assert read_throttling((missing, empty)) is None
    before = read_throttling((missing, empty, v1))
    v1.write_text(V1.replace("nr_periods 500", "nr_periods 900").replace("nr_throttled 4", "nr_throttled 10")
                  .replace("throttled_time 310000000", "throttled_time 810000000"))
    run = throttling_between(before, read_throttling((missing, empty, v1)))
    assert run.periods == 400 and run.throttled_periods == 6 and abs(run.throttled_s - 0.5) < 1e-9
    assert throttling_between(None, before) is None


PSI = """some avg10=7.50 avg60=5.86 avg300=26.10 total=17179221922
full avg10=0.00 avg60=0.00 avg300=0.00 total=0
"""


def test_cpu_pressure_is_the_some_lines_total_in_seconds(tmp_path):
    assert parse_cpu_pressure_s(PSI) == 17179.221922
    assert parse_cpu_pressure_s("full avg10=0.00 total=5\n") is None
    cgroup, machine = tmp_path / "cpu.pressure", tmp_path / "cpu"
    machine.write_text(PSI)
    assert read_cpu_pressure_s((cgroup, machine)) == 17179.221922  # the cgroup's file missing: the machine's
    assert read_cpu_pressure_s((cgroup,)) is None


def test_the_summary_says_what_held_the_run_off_the_cpu_or_that_it_could_not_tell():
    held = summarize([], 10.0, SLO(2.0, 0.05), cpu_throttling=Throttling(400, 6, 0.5), cpu_pressure_s=2.5)
    assert held["cpu_throttling"] == {"periods": 400, "throttled_periods": 6, "throttled_s": 0.5}
    assert held["cpu_pressure_s"] == 2.5
    lines = summary_lines(held)
    assert "throttled in 6 of 400 periods, 500 ms in all" in lines
    assert "a runnable task waited for a CPU: 2.5 s of the run's 10.0 s" in lines
    unknown = summary_lines(summarize([], 1.0, SLO(2.0, 0.05)))
    assert "CPU quota (the client's cgroup): not readable; a runnable task waited for a CPU: not readable" in unknown
