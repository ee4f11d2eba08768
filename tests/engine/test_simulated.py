"""The simulated engine: the real scheduler, page pool, prefix cache and KV events around a runner that sleeps what
a measured step profile predicts; checked against the profile's own table and through a whole in-process cluster."""

import time

import pytest

from pdserve import SamplingParams
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile

from probes import HTTP, metric_total

PROFILE = StepProfile.load(DEFAULT_PROFILE)
TIMEOUT_S = 60.0


def engine(tiny_v2: str, **options) -> Engine:
    return Engine(EngineConfig(model=tiny_v2, execution="simulated", time_scale=0.01, page_size=16, progress=False,
                               **options))


def test_a_simulated_engine_schedules_caches_and_accounts_each_step_by_the_profile(tiny_v2):
    sim = engine(tiny_v2, num_pages=64)
    prompt = list(range(5, 5 + 100))
    sim.add_request("a", prompt, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    outputs = []
    while sim.has_work():
        outputs += sim.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert len(tokens) == 6 and all(0 <= t < sim.model_config.vocab_size for t in tokens)
    # One 100-token prefill, then five one-token decodes at contexts 101..105.
    want_ms = PROFILE.prefill_step_ms(100) + sum(PROFILE.decode_step_ms(1, c) for c in range(101, 106))
    assert sim.runner.simulated_s * 1000 == pytest.approx(want_ms)
    # The prefix cache is the real one: the same prompt again finds its full pages cached.
    sim.add_request("b", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    finished = []
    while sim.has_work():
        finished += sim.step()
    assert finished[-1].cached_tokens == 96  # six full 16-token pages of the 100
    assert sim.stats().expert_weight_bytes == 0


def test_a_simulated_step_counts_its_sleep_as_the_hosts_wait_for_the_device(tiny_v2):
    """What the step trace's wait_ms reads: the simulated device computes while the host sleeps."""
    sim = engine(tiny_v2, num_pages=64)
    sim.add_request("a", list(range(5, 105)), SamplingParams(max_tokens=1, temperature=0.0))
    before_s = sim.runner.simulated_s
    sim.step()
    slept_s = (sim.runner.simulated_s - before_s) * sim.runner.time_scale
    assert slept_s > 0 and slept_s <= sim.last_step_wait_s < slept_s + 0.5


def test_a_simulated_pool_is_sized_like_the_profiled_gpu_pool_and_experts_are_refused(tiny_v2):
    assert engine(tiny_v2).allocator.num_pages == PROFILE.kv_pool_tokens // 16
    with pytest.raises(ValueError, match="no experts"):
        Engine(EngineConfig(model=tiny_v2, execution="simulated", progress=False), wrap_moe=lambda moe: moe)


def test_simulated_prefill_and_decode_workers_serve_through_the_router_in_profile_time(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1,
                        worker_args=("--engine", "simulated", "--page-size", "64", "--no-warmup"))
    with InProcessCluster(cfg) as cluster:
        prefill, decode = cluster.workers
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        started = time.monotonic()
        response = HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": [3 + i % 500 for i in range(2000)], "max_tokens": 20, "ignore_eos": True})
        elapsed_s = time.monotonic() - started
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 20
        # A 2000-token prefill and 19 decode steps at ~8 ms each, as the profile says (plus the path's own time).
        floor_s = (PROFILE.prefill_step_ms(2000) + 19 * PROFILE.decode_step_ms(1, 2000)) / 1000
        assert elapsed_s >= floor_s
        assert metric_total(prefill.url, "pdserve_kv_transfer_seconds_count") >= 1  # the KV crossed pools
