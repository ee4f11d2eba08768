from pytest import approx

from pdserve.engine.step_shape import StepShape
from pdserve.worker.step_speeds import SMOOTHING, StepSpeeds


def test_prompt_turns_set_the_prefill_speed_and_decode_only_turns_the_decode_step():
    speeds = StepSpeeds()
    speeds.turn_ended(1.0)  # nothing open: no change
    assert speeds.prefill_tokens_per_s == 0.0 and speeds.decode_step_s == 0.0
    speeds.turn_started(10.0, StepShape(decode_batch=4, decode_context=100.0, prefill_tokens=1000))
    speeds.turn_ended(10.5)
    assert speeds.prefill_tokens_per_s == approx(2000.0)  # the first measurement is taken whole
    assert speeds.decode_step_s == 0.0  # a mixed turn is no decode step
    speeds.turn_started(11.0, StepShape(decode_batch=4, decode_context=101.0))
    speeds.turn_ended(11.02)
    assert speeds.prefill_tokens_per_s == approx(2000.0) and speeds.decode_step_s == approx(0.02)
    speeds.turn_started(12.0, StepShape(prefill_tokens=4000))
    speeds.turn_ended(13.0)
    assert speeds.prefill_tokens_per_s == approx((1 - SMOOTHING) * 2000.0 + SMOOTHING * 4000.0)
    speeds.turn_started(13.0, StepShape(decode_batch=8, decode_context=50.0))
    speeds.turn_ended(13.04)
    assert speeds.decode_step_s == approx((1 - SMOOTHING) * 0.02 + SMOOTHING * 0.04)
    speeds.turn_started(14.0, StepShape())  # a turn that computed nothing does not count
    speeds.turn_ended(20.0)
    speeds.turn_ended(30.0)  # already closed
    assert speeds.decode_step_s == approx((1 - SMOOTHING) * 0.02 + SMOOTHING * 0.04)
    assert speeds.prefill_tokens_per_s == approx((1 - SMOOTHING) * 2000.0 + SMOOTHING * 4000.0)
