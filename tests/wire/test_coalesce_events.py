"""coalesce_events: a run of one request's events read as one event carries exactly what the run did; token_gaps: the
inter-token gaps such an event stands for."""

from pdserve.wire.protocol import TokenEvent, coalesce_events, token_gaps


def test_a_run_becomes_one_event_with_every_token_and_logprob_in_order():
    run = [TokenEvent("r", [1], "a", [-0.1], [[1, 2]], [[-0.1, -2.0]], prompt_tokens=5, cached_tokens=4),
           TokenEvent("r", [2, 3], "bc", [-0.2, -0.3], [[2, 1], [3, 1]], [[-0.2, -3.0], [-0.3, -4.0]]),
           TokenEvent("r", [4], "d", [-0.4], [[4, 1]], [[-0.4, -5.0]], finish_reason="length")]
    [merged] = coalesce_events(run)
    assert merged.token_ids == [1, 2, 3, 4] and merged.text == "abcd"
    assert merged.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert merged.top_token_ids == [[1, 2], [2, 1], [3, 1], [4, 1]]
    assert merged.top_logprobs == [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0], [-0.4, -5.0]]
    assert merged.finish_reason == "length" and merged.prompt_tokens == 5 and merged.cached_tokens == 4


def test_without_logprobs_they_stay_absent_and_an_error_stays_its_own_event():
    run = [TokenEvent("r", [1], "a"), TokenEvent("r", [2], "b"),
           TokenEvent("r", [], finish_reason="error", error="rank 0 failed")]
    merged, error = coalesce_events(run)
    assert merged.token_ids == [1, 2] and merged.text == "ab" and merged.finish_reason is None
    assert merged.logprobs is None and merged.top_token_ids is None
    assert error is run[-1]


def test_a_single_event_is_left_as_it_is():
    event = TokenEvent("r", [7], "x", finish_reason="stop")
    assert coalesce_events([event])[0] is event


def test_every_token_after_the_first_is_one_gap_however_the_tokens_were_batched():
    # 5 tokens: 3 in the first event at t=1.0, then 2 together at t=1.5.
    gaps = token_gaps(None, 1.0, 3) + token_gaps(1.0, 1.5, 2)
    assert gaps == (0.0, 0.0, 0.25, 0.25)
    assert token_gaps(None, 1.0, 1) == ()
    assert token_gaps(2.0, 2.5, 1) == (0.5,)
