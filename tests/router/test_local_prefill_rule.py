"""Conditional disaggregation's rule on measured loads: the prefill rank's queued prompt tokens at its prefill speed
(how long a prompt would wait there), and the decode rank's step with a chunk of prompt beside its decodes (the
inter-token gap its requests would see), for as many steps as its queued prompts and this one take."""

from dataclasses import replace

from pdserve_router.policies import MAX_SAVED_LONG_STEPS, LocalPrefillRule, LongStepAllowance


def test_off_by_default_and_bounded_by_the_prompt_and_the_queue():
    assert not LocalPrefillRule().enabled
    rule = LocalPrefillRule(max_tokens=64, min_prefill_queue=2)
    assert rule.enabled
    assert rule.prefill_on_decode(64, 2, 0, 0.0, 0, 0.0, 0)
    assert not rule.prefill_on_decode(65, 2, 0, 0.0, 0, 0.0, 0)  # too long
    assert not rule.prefill_on_decode(64, 1, 0, 0.0, 0, 0.0, 0)  # the prefill rank is not busy


def test_a_prefill_rank_is_busy_when_its_queue_takes_long_at_its_measured_speed():
    rule = LocalPrefillRule(max_tokens=512, min_prefill_queue=0, min_wait_s=0.1)
    assert rule.prefill_on_decode(100, 0, 2_000, 10_000.0, 0, 0.0, 0)  # 200 ms of queued prompt
    assert not rule.prefill_on_decode(100, 0, 500, 10_000.0, 0, 0.0, 0)  # 50 ms
    assert not rule.prefill_on_decode(100, 5, 100_000, 0.0, 0, 0.0, 0)  # not measured yet: no wait can be told


def test_the_decode_rank_takes_a_prompt_only_where_its_step_with_a_chunk_stays_short():
    rule = LocalPrefillRule(max_tokens=100_000, min_prefill_queue=0, max_stall_s=0.05)
    busy = 10_000  # prompt tokens queued on the prefill rank: 1 s at 10k tokens/s
    assert rule.prefill_on_decode(400, 0, busy, 10_000.0, 0, 0.005, 0)  # 5 + 40 ms, whole
    assert not rule.prefill_on_decode(600, 0, busy, 10_000.0, 0, 0.0, 0)  # 60 ms, whole
    assert not rule.prefill_on_decode(400, 0, busy, 10_000.0, 0, 0.015, 0)  # 15 + 40 ms: the decodes count
    assert not rule.prefill_on_decode(400, 0, busy, 10_000.0, 200, 0.0, 0)  # 40 ms after 20 ms queued there
    # In chunks of 300 tokens, 6 steps of 5 + 30 ms: 210 ms, against 1.18 s behind the prefill rank's queue.
    assert rule.prefill_on_decode(1_800, 0, busy, 10_000.0, 0, 0.005, 300)
    assert not rule.prefill_on_decode(1_800, 0, busy, 10_000.0, 0, 0.025, 300)  # 25 + 30 ms a step
    assert not rule.prefill_on_decode(400, 0, busy, 0.0, 0, 0.005, 300)  # no speed measured: no step can be told


def test_the_decode_rank_takes_a_prompt_only_where_it_is_done_sooner_than_the_prefill_rank():
    rule = LocalPrefillRule(max_tokens=100_000, min_prefill_queue=0, max_stall_s=0.05)
    # 20 chunks of 300 at 5 + 30 ms: 700 ms, against (2,000 + 6,000) / 10k = 800 ms on the prefill rank...
    assert rule.prefill_on_decode(6_000, 0, 2_000, 10_000.0, 0, 0.005, 300)
    # ...but 1.05 s after 3,000 tokens already queued on the decode rank
    assert not rule.prefill_on_decode(6_000, 0, 2_000, 10_000.0, 3_000, 0.005, 300)
    assert not rule.prefill_on_decode(6_000, 0, 0, 10_000.0, 0, 0.005, 300)  # the prefill rank is idle: 600 ms


def test_steps_past_the_stall_bound_spend_an_allowance_the_decode_steps_earn():
    rule = LocalPrefillRule(max_tokens=100_000, min_prefill_queue=0, max_stall_s=0.05, long_step_share=0.01)
    allowance = LongStepAllowance()
    allowance.saved = 4.0
    # 4,000 tokens in chunks of 2,000 at 20k tokens/s beside 10 ms decode steps: 2 steps of 110 ms (past 50 ms),
    # done in 220 ms against 500 ms behind 6,000 queued tokens on the prefill rank
    args = (4_000, 0, 6_000, 20_000.0, 0, 0.01, 2_000)
    assert rule.prefill_on_decode(*args, allowance, now_s=100.0) and allowance.saved == 2.0
    assert rule.prefill_on_decode(*args, allowance, now_s=100.0) and allowance.saved == 0.0
    assert not rule.prefill_on_decode(*args, allowance, now_s=100.0)  # spent
    assert not rule.prefill_on_decode(*args, allowance, now_s=101.0)  # 100 steps later: 1 earned
    assert rule.prefill_on_decode(*args, allowance, now_s=102.0) and allowance.saved == 0.0  # 2 earned
    assert not rule.prefill_on_decode(*args, None, now_s=200.0)  # no allowance: the bound is hard
    # Earning stops at MAX_SAVED_LONG_STEPS however long the rank was quiet.
    assert not replace(rule, long_step_share=0.0).prefill_on_decode(*args, allowance, 1e6)
    allowance.earn(1e9, 0.01, 0.01)
    assert allowance.saved == MAX_SAVED_LONG_STEPS
    # A decode rank whose step alone is past the bound earns the same way: its steps are rarer.
    assert rule.prefill_on_decode(4_000, 0, 60_000, 20_000.0, 0, 0.1, 2_000, allowance, 1e9)
    assert allowance.saved == MAX_SAVED_LONG_STEPS - 2
