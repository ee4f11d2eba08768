"""Conditional disaggregation's rule on measured loads: the prefill rank's queued prompt tokens at its prefill speed
(how long a prompt would wait there), and the prompt at the decode rank's speed (how long its decodes would stall)."""

from pdserve_router.policies import LocalPrefillRule


def test_off_by_default_and_bounded_by_the_prompt_and_the_queue():
    assert not LocalPrefillRule().enabled
    rule = LocalPrefillRule(max_tokens=64, min_prefill_queue=2)
    assert rule.enabled
    assert rule.prefill_on_decode(64, 2, 0, 0.0, 0, 0.0)
    assert not rule.prefill_on_decode(65, 2, 0, 0.0, 0, 0.0)  # too long
    assert not rule.prefill_on_decode(64, 1, 0, 0.0, 0, 0.0)  # the prefill rank is not busy


def test_a_prefill_rank_is_busy_when_its_queue_takes_long_at_its_measured_speed():
    rule = LocalPrefillRule(max_tokens=512, min_prefill_queue=0, min_wait_s=0.1)
    assert rule.prefill_on_decode(100, 0, 2_000, 10_000.0, 0, 0.0)  # 200 ms of queued prompt
    assert not rule.prefill_on_decode(100, 0, 500, 10_000.0, 0, 0.0)  # 50 ms
    assert not rule.prefill_on_decode(100, 5, 100_000, 0.0, 0, 0.0)  # not measured yet: no wait can be told


def test_the_decode_rank_takes_a_prompt_only_where_its_decodes_stall_briefly():
    rule = LocalPrefillRule(max_tokens=4096, min_prefill_queue=0, max_stall_s=0.05)
    assert rule.prefill_on_decode(400, 0, 0, 0.0, 0, 10_000.0)  # 40 ms at the decode rank's speed
    assert not rule.prefill_on_decode(600, 0, 0, 0.0, 0, 10_000.0)  # 60 ms
    assert not rule.prefill_on_decode(400, 0, 0, 0.0, 200, 10_000.0)  # 40 ms after 20 ms already queued there
    assert not rule.prefill_on_decode(600, 0, 0, 10_000.0, 0, 0.0)  # the prefill rank's speed stands in
    assert rule.prefill_on_decode(600, 0, 0, 0.0, 0, 0.0)  # nothing measured anywhere: the token bound alone
