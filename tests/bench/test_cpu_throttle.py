"""The CFS throttling a run reports, from cgroup v2's and v1's cpu.stat."""

from pdserve.bench.cpu_throttle import Throttling, parse_cpu_stat, read_throttling, throttling_between
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


def test_the_summary_says_what_the_quota_held_back_or_that_it_could_not_tell():
    held = summarize([], 1.0, SLO(2.0, 0.05), cpu_throttling=Throttling(400, 6, 0.5))
    assert held["cpu_throttling"] == {"periods": 400, "throttled_periods": 6, "throttled_s": 0.5}
    assert "throttled in 6 of 400 periods, 500 ms in all" in summary_lines(held)
    assert "CPU quota (the client's cgroup): not readable" in summary_lines(summarize([], 1.0, SLO(2.0, 0.05)))
