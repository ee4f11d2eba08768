"""A measured step profile: its own points come back, and between them it interpolates (bilinear for decodes)."""

import pytest

from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile, interpolate

PROFILE = StepProfile.load(DEFAULT_PROFILE)


def test_the_profile_returns_its_measured_points_and_interpolates_between_them():
    for b, batch in enumerate(PROFILE.decode_batches):
        for c, context in enumerate(PROFILE.decode_contexts):
            assert PROFILE.decode_step_ms(batch, context) == pytest.approx(PROFILE.decode_ms[b][c])
    for tokens, ms in zip(PROFILE.prefill_tokens, PROFILE.prefill_ms):
        assert PROFILE.prefill_step_ms(tokens) == pytest.approx(ms)
    # Halfway between two batches and two contexts: the mean of the four corners (bilinear).
    corners = [PROFILE.decode_ms[i][j] for i in (2, 3) for j in (0, 1)]
    assert PROFILE.decode_step_ms(160, 2560) == pytest.approx(sum(corners) / 4)
    assert interpolate(20_000, [1, 10], [1.0, 10.0]) == pytest.approx(20_000)  # extended past the last point
    assert interpolate(-5, [0, 10], [1.0, 0.0]) == pytest.approx(1.5)
    assert interpolate(50, [0, 10], [1.0, 0.0]) == 0.0  # never negative


def test_every_shipped_profile_loads_and_prices_steps_that_grow_with_work():
    profiles = sorted(DEFAULT_PROFILE.parent.glob("*.json"))
    assert len(profiles) >= 2, profiles
    for path in profiles:
        profile = StepProfile.load(path)
        assert 0 < profile.decode_step_ms(1, 2048) < profile.decode_step_ms(128, 2048), path
        assert 0 < profile.prefill_step_ms(1) < profile.prefill_step_ms(8192), path
