import pytest

from pdserve.bench.client import RequestResult
from pdserve.bench.report import SLO, compare_table, meets_slo, percentile, summarize, within_slo


def test_percentile_interpolates_like_numpy_linear():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([], 50) is None


def _result(index: int, ttft_s: float, itl_s: list[float], ok: bool = True) -> RequestResult:
    return RequestResult(index=index, ok=ok, ttft_s=ttft_s, e2e_s=ttft_s + sum(itl_s), itl_s=itl_s,
                         prompt_tokens=10, output_tokens=len(itl_s) + 1)


def test_goodput_counts_only_requests_meeting_both_slos():
    slo = SLO(ttft_s=1.0, itl_p99_s=0.1)
    results = [
        _result(0, 0.5, [0.05, 0.05]),  # meets both
        _result(1, 1.5, [0.05]),  # TTFT too slow
        _result(2, 0.5, [0.05, 0.5]),  # ITL p99 too slow
        _result(3, 0.2, [0.01], ok=False),  # failed
    ]
    assert [meets_slo(r, slo) for r in results] == [True, False, False, False]
    summary = summarize(results, duration_s=2.0, slo=slo)
    assert summary["goodput_requests_per_s"] == pytest.approx(0.5)
    assert summary["requests_per_s"] == pytest.approx(1.5) and summary["failed"] == 1
    assert summary["output_tokens"] == 3 + 2 + 3
    assert summary["ttft_s"]["p50"] == pytest.approx(0.5)
    assert not within_slo(summary, slo)


def test_compare_table_shows_ratio_of_right_to_left():
    slo = SLO(1.0, 0.1)
    left = {"summary": summarize([_result(0, 0.4, [0.02])], 1.0, slo)}
    right = {"summary": summarize([_result(0, 0.2, [0.02])], 1.0, slo)}
    table = compare_table(left, right, "colocated", "pd")
    ttft_row = next(line for line in table.splitlines() if line.startswith("| TTFT p50"))
    assert ttft_row == "| TTFT p50 (ms) | 400 | 200 | 0.50 |"
