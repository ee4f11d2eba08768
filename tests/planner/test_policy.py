"""The planner's decision: pool sizes from traffic, the profile and measured latency; up at once, down after a
window; within bounds."""

import math

import pytest

from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.planner.capacity import decode_capacity, prefill_tokens_per_s, prefill_utilization_for_ttft
from pdserve.planner.config import PlannerConfig
from pdserve.planner.policy import Planner, PoolSizes, rate_trend
from pdserve.planner.traffic import Traffic

PROFILE = StepProfile.load(DEFAULT_PROFILE)
CFG = PlannerConfig(interval_s=10, lookahead_s=0, scale_down_window_s=60, max_prefill=64, max_decode=64,
                    slo_itl_s=0.03)


def traffic(rate: float, prompt: float = 2000, output: float = 200, ttft_p99_s: float = 0.1,
            itl_p99_s: float = 0.01) -> Traffic:
    return Traffic(10.0, rate, prompt, output, ttft_p99_s, itl_p99_s)


def test_no_traffic_needs_only_the_smallest_pools():
    decision = Planner(CFG, PROFILE).decide(traffic(0.0), PoolSizes(3, 3), at_s=0)
    assert decision.target == PoolSizes(CFG.min_prefill, CFG.min_decode)


def test_pools_are_sized_from_the_profile_at_the_slo():
    rate = 40.0
    decision = Planner(CFG, PROFILE).decide(traffic(rate), PoolSizes(1, 1), at_s=0)
    throughput = prefill_tokens_per_s(PROFILE, CFG.prefill_chunk_tokens)
    prefill_per_rank = throughput * prefill_utilization_for_ttft(2000 / throughput, CFG.slo_ttft_s * CFG.ttft_headroom,
                                                                 CFG.prefill_utilization)
    decode = decode_capacity(PROFILE, CFG.slo_itl_s * CFG.itl_headroom, 2000 + 200 / 2, CFG.max_decode_batch)
    assert decision.needed == PoolSizes(math.ceil(rate * 2000 / prefill_per_rank),
                                        math.ceil(rate * 200 / decode.tokens_per_s))
    assert decision.target == decision.needed and decision.target.prefill > 1


def test_ranks_per_worker_divide_the_workers_needed():
    one = Planner(CFG, PROFILE).decide(traffic(40.0), PoolSizes(1, 1), at_s=0).needed
    cfg = PlannerConfig(**{**vars(CFG), "prefill_ranks_per_worker": 4, "decode_ranks_per_worker": 4})
    four = Planner(cfg, PROFILE).decide(traffic(40.0), PoolSizes(1, 1), at_s=0).needed
    assert four == PoolSizes(math.ceil(one.prefill / 4), math.ceil(one.decode / 4))


def test_a_rising_rate_is_planned_for_where_it_will_be_after_the_lookahead():
    assert rate_trend([(0, 1.0), (10, 2.0), (20, 3.0)]) == pytest.approx(0.1)
    planner = Planner(PlannerConfig(**{**vars(CFG), "lookahead_s": 30}), PROFILE)
    planner.decide(traffic(10.0), PoolSizes(1, 1), at_s=0)
    decision = planner.decide(traffic(20.0), PoolSizes(1, 1), at_s=10)
    assert decision.predicted_rate == pytest.approx(20.0 + 1.0 * 30)
    falling = planner.decide(traffic(5.0), PoolSizes(1, 1), at_s=20)
    assert falling.predicted_rate == pytest.approx(5.0)  # falling load: planned where it is, not below


def test_pools_grow_at_once_and_shrink_only_after_the_window():
    planner = Planner(CFG, PROFILE)
    high = planner.decide(traffic(40.0), PoolSizes(1, 1), at_s=0).target
    assert planner.decide(traffic(1.0), high, at_s=30).target == high  # inside the window
    low = planner.decide(traffic(1.0), high, at_s=61).target
    assert low.prefill < high.prefill and low == planner.decide(traffic(1.0), low, at_s=62).needed


def test_the_bounds_hold():
    cfg = PlannerConfig(**{**vars(CFG), "max_prefill": 2, "max_decode": 3, "min_decode": 2})
    planner = Planner(cfg, PROFILE)
    assert planner.decide(traffic(1000.0), PoolSizes(1, 1), at_s=0).target == PoolSizes(2, 3)
    assert Planner(cfg, PROFILE).decide(traffic(0.0), PoolSizes(1, 1), at_s=0).target == PoolSizes(1, 2)


def test_a_loaded_pool_missing_its_latency_target_gets_one_worker_more_than_the_model_asks():
    """Loaded: the model puts the traffic at over half of what the pools as they are take at the SLO."""
    loaded = Planner(CFG, PROFILE).decide(traffic(40.0), PoolSizes(1, 1), at_s=0).needed
    slow_prefill = Planner(CFG, PROFILE).decide(traffic(40.0, ttft_p99_s=CFG.slo_ttft_s * 2), loaded, at_s=0)
    assert slow_prefill.needed.prefill == loaded.prefill + 1 and "TTFT" in slow_prefill.reasons[-1]
    slow_decode = Planner(CFG, PROFILE).decide(traffic(40.0, itl_p99_s=CFG.slo_itl_s * 2), loaded, at_s=0)
    assert slow_decode.needed.decode == loaded.decode + 1 and "ITL" in slow_decode.reasons[-1]


def test_a_lightly_loaded_pool_counts_a_latency_miss_only_when_it_repeats():
    for slow, one_more in ((dict(ttft_p99_s=CFG.slo_ttft_s * 2), PoolSizes(3, 1)),
                           (dict(itl_p99_s=CFG.slo_itl_s * 2), PoolSizes(1, 3))):
        planner = Planner(CFG, PROFILE)
        once = planner.decide(traffic(1.0, **slow), PoolSizes(2, 2), at_s=0)
        assert once.needed == PoolSizes(1, 1) and "counted if it repeats" in once.reasons[-1]
        again = planner.decide(traffic(1.0, **slow), PoolSizes(2, 2), at_s=10)
        assert again.needed == one_more and "worker more" in again.reasons[-1]  # the pool that missed: 2 + 1
        recovered = planner.decide(traffic(1.0), PoolSizes(2, 2), at_s=20)
        assert recovered.needed == PoolSizes(1, 1)


def test_a_worker_added_for_a_miss_is_not_followed_by_more_while_the_miss_stays_at_a_lower_load():
    """The miss that outlives the worker added for it, at the lower load that worker made, is not a lack of workers:
    no more are added until the load comes back or an interval passes without a miss."""
    decode = decode_capacity(PROFILE, CFG.slo_itl_s * CFG.itl_headroom, 2000 + 200 / 2, CFG.max_decode_batch)
    rate = 0.75 * decode.tokens_per_s / 200  # three quarters of one decode rank: loaded alone, light with two
    slow = dict(itl_p99_s=CFG.slo_itl_s * 2)
    planner = Planner(CFG, PROFILE)
    assert planner.decide(traffic(rate), PoolSizes(8, 1), at_s=0).needed.decode == 1
    loaded_miss = planner.decide(traffic(rate, **slow), PoolSizes(8, 1), at_s=10)
    assert loaded_miss.needed.decode == 2 and "one decode worker more" in loaded_miss.reasons[-1]
    for at_s in (20, 30):  # light now, missing again and again: the worker added did not help
        stays = planner.decide(traffic(rate, **slow), PoolSizes(8, 2), at_s=at_s)
        assert stays.needed.decode == 1 and "after a worker added for it at 75%: not counted" in stays.reasons[-1]
    planner.decide(traffic(rate), PoolSizes(8, 2), at_s=40)  # no miss: the record goes
    assert "counted if it repeats" in planner.decide(traffic(rate, **slow), PoolSizes(8, 2), at_s=50).reasons[-1]
    assert planner.decide(traffic(rate, **slow), PoolSizes(8, 2), at_s=60).needed.decode == 3


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min <= max"):
        PlannerConfig(min_prefill=3, max_prefill=2)
    with pytest.raises(ValueError, match="prefill_utilization"):
        PlannerConfig(prefill_utilization=0)


def test_an_interval_where_requests_started_but_none_finished_keeps_the_last_known_lengths():
    planner = Planner(CFG, PROFILE)
    known = planner.decide(traffic(40.0), PoolSizes(1, 1), at_s=0).needed
    assert planner.decide(traffic(40.0, prompt=0.0, output=0.0), known, at_s=10).needed == known
