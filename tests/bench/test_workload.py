from dataclasses import replace

import pytest

from pdserve.bench.workload import BenchRequest, LengthRange, WorkloadConfig, best_prefix_hit_ratio, generate_workload

SHARED = WorkloadConfig(num_requests=30, seed=5, request_rate=4.0, num_prefix_groups=3, system_prompt_len=40,
                        turns_per_conversation=2, long_fraction=0.2, prompt_len=LengthRange(5, 20),
                        long_prompt_len=LengthRange(100, 200))


def test_same_seed_gives_identical_workload_and_other_seed_differs():
    assert generate_workload(SHARED) == generate_workload(SHARED)
    assert generate_workload(SHARED) != generate_workload(replace(SHARED, seed=6))


def test_groups_share_system_prompt_and_arrive_interleaved():
    requests = generate_workload(SHARED)
    grouped = [r for r in requests if r.group is not None and r.turn == 0]
    for request in grouped:
        first_of_group = next(r for r in grouped if r.group == request.group)
        assert request.prompt_token_ids[:40] == first_of_group.prompt_token_ids[:40]
    assert [r.group for r in grouped[:3]] == [0, 1, 2]
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and len(requests) == 30


def test_later_turn_resends_its_history():
    requests = generate_workload(SHARED)
    for request in requests:
        if request.previous_turn is not None:
            previous = requests[request.previous_turn]
            assert request.conversation == previous.conversation and request.turn == previous.turn + 1
            assert request.prompt_token_ids[: len(previous.prompt_token_ids)] == previous.prompt_token_ids
            assert len(request.prompt_token_ids) > len(previous.prompt_token_ids)


def test_token_ids_stay_in_range_and_lengths_in_bounds():
    cfg = WorkloadConfig(num_requests=50, max_concurrency=4, prompt_len=LengthRange(3, 9),
                         output_len=LengthRange(2, 4), token_id_low=7, token_id_high=11)
    for request in generate_workload(cfg):
        assert 3 <= len(request.prompt_token_ids) <= 9 and 2 <= request.max_tokens <= 4
        assert all(7 <= t < 11 for t in request.prompt_token_ids)
        assert request.arrival_s == 0.0


def test_config_rejects_no_arrival_process():
    with pytest.raises(ValueError, match="request_rate"):
        WorkloadConfig(num_requests=1)


def _request(index: int, prompt: list[int]) -> BenchRequest:
    return BenchRequest(index, 0.0, tuple(prompt), 1, 0, index, 0, None)


def test_best_hit_ratio_counts_full_shared_pages_and_first_request_misses():
    system = list(range(100, 132))  # two pages of 16
    requests = [_request(0, system + [1, 2, 3]), _request(1, system + [4, 5]), _request(2, list(range(200, 235)))]
    # request 1 hits 32 of 34 tokens; requests 0 and 2 miss everything.
    assert best_prefix_hit_ratio(requests, page_size=16) == pytest.approx(32 / (35 + 34 + 35))


def test_best_hit_ratio_never_matches_the_last_token():
    prompt = list(range(100, 132))  # exactly two pages: the second cannot be matched (one token is computed)
    assert best_prefix_hit_ratio([_request(0, prompt), _request(1, prompt)], 16) == pytest.approx(16 / 64)
