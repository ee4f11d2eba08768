"""What a rank can take at the SLO, read from the step profile."""

import math

import pytest

from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.planner.capacity import decode_capacity, prefill_tokens_per_s, prefill_utilization_for_ttft

PROFILE = StepProfile.load(DEFAULT_PROFILE)


def test_prefill_throughput_is_a_chunk_over_its_step_time():
    assert prefill_tokens_per_s(PROFILE, 4096) == pytest.approx(4096 / (PROFILE.prefill_step_ms(4096) / 1000))


@pytest.mark.parametrize("target_ms", [16.0, 24.0, 30.0])
def test_the_decode_batch_is_the_largest_whose_step_fits_the_target(target_ms):
    capacity = decode_capacity(PROFILE, target_ms / 1000, 4096, max_batch=10_000)
    assert capacity.meets_itl
    assert PROFILE.decode_step_ms(capacity.batch, 4096) <= target_ms
    assert PROFILE.decode_step_ms(capacity.batch + 1, 4096) > target_ms
    assert capacity.tokens_per_s == pytest.approx(capacity.batch / capacity.step_s)


def test_the_decode_batch_is_bounded_by_max_batch_and_by_what_the_kv_pool_holds():
    assert decode_capacity(PROFILE, 1.0, 4096, max_batch=256).batch == 256
    long_context = PROFILE.kv_pool_tokens / 10  # only 10 such sequences fit in the pool
    assert decode_capacity(PROFILE, 10.0, long_context, max_batch=256).batch == 10


def test_a_target_below_one_sequences_step_is_reported_unreachable():
    capacity = decode_capacity(PROFILE, 0.001, 4096, max_batch=256)
    assert not capacity.meets_itl and capacity.batch == 1


def test_the_prefill_share_is_the_largest_whose_mm1_p99_queueing_and_prefill_fit_the_ttft_budget():
    service, budget = 0.05, 1.6
    rho = prefill_utilization_for_ttft(service, budget, cap=1.0)
    p99 = service * math.log(100 * rho) / (1 - rho) + service  # M/M/1: P(W > t) = rho exp(-(1 - rho) t / S)
    assert 0.8 < rho < 0.95 and p99 == pytest.approx(budget, rel=1e-6)
    assert prefill_utilization_for_ttft(service * 4, budget, cap=1.0) < rho  # longer prompts queue less deep
    assert prefill_utilization_for_ttft(service, budget, cap=0.5) == 0.5  # the cap binds
    assert prefill_utilization_for_ttft(2.0, budget, cap=0.9) == 0.9  # a prompt alone misses: no share helps
