from pytest import approx

from pdserve.worker.prefill_rate import SMOOTHING, PrefillRate


def test_turns_with_prompt_tokens_set_a_moving_average_and_others_leave_it():
    rate = PrefillRate()
    rate.turn_ended(1.0)  # nothing open: no change
    assert rate.tokens_per_s == 0.0
    rate.turn_started(10.0, 1000)
    rate.turn_ended(10.5)
    assert rate.tokens_per_s == approx(2000.0)  # the first measurement is taken whole
    rate.turn_started(11.0, 0)  # a decode-only turn
    rate.turn_ended(12.0)
    assert rate.tokens_per_s == approx(2000.0)
    rate.turn_started(12.0, 4000)
    rate.turn_ended(13.0)
    assert rate.tokens_per_s == approx((1 - SMOOTHING) * 2000.0 + SMOOTHING * 4000.0)
    rate.turn_ended(20.0)  # already closed
    assert rate.tokens_per_s == approx((1 - SMOOTHING) * 2000.0 + SMOOTHING * 4000.0)
