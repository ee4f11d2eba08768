"""The host tier gives a prompt back the very KV it had: a prompt served from host pages (evicted while other
requests' steps were in flight) makes the tokens and log-probabilities, bit for bit, that the same prompt made from
the device prefix cache. On CUDA the copies run on the step's stream, under overlapped steps and decode graphs."""

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.wire.sampling import SamplingParams
from tests.engine.test_cuda_graphs import FLASHINFER_SHAPE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PAGE_SIZE = 16
SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)


def run(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SAMPLING)
    made: dict[str, tuple[list[int], list[float]]] = {request_id: ([], []) for request_id in prompts}
    while engine.has_work():
        for output in engine.step():
            made[output.request_id][0].extend(output.new_token_ids)
            made[output.request_id][1].extend(output.new_logprobs or [])
    return made


def check_host_hit_equals_device_hit(model: str, **options) -> None:
    engine = Engine(EngineConfig(model=model, page_size=PAGE_SIZE, num_pages=40, host_kv_cache_gib=0.05,
                                 progress=False, **options))
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(2, 400, (200,), generator=gen).tolist()  # 12 full pages
    others = {f"o{i}": torch.randint(2, 400, (150,), generator=gen).tolist() for i in range(4)}
    run(engine, {"cold": prompt})
    from_device = run(engine, {"device": prompt})["device"]
    host = engine.prefix_cache.host_tier
    run(engine, others)  # 4 x 10 pages through a 40-page pool: the prompt's pages leave it mid-batch
    assert host.offloaded_pages >= 12
    loaded_before = host.loaded_pages
    from_host = run(engine, {"host": prompt})["host"]
    assert host.loaded_pages - loaded_before == 199 // PAGE_SIZE
    assert from_host == from_device
    engine.prefix_cache.check_integrity()


def test_a_host_hit_makes_the_device_hits_tokens_and_logprobs(tiny_v2):
    check_host_hit_equals_device_hit(tiny_v2, dtype="float32")


@pytest.mark.gpu
@needs_cuda
def test_a_host_hit_makes_the_device_hits_tokens_and_logprobs_on_cuda(tiny_model_factory):
    model = tiny_model_factory("v2", **FLASHINFER_SHAPE)
    check_host_hit_equals_device_hit(model, device="cuda", dtype="bfloat16", cuda_graphs=True,
                                     overlap_scheduling="on", max_num_seqs=8)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_shared_prefixes_through_a_small_pool_and_the_host_tier_give_the_reference_tokens(tiny_v2, overlap):
    """Prompts sharing system prompts, three at a time through a pool that holds about one of them: pages go to the
    host tier and come back mid-run (with overlapped steps in flight too), and every request makes the tokens it
    makes alone with no cache at all."""
    gen = torch.Generator().manual_seed(6)
    systems = [torch.randint(2, 400, (n,), generator=gen).tolist() for n in (48, 80, 33)]
    prompts = [systems[i % 3] + torch.randint(2, 400, (5 + 7 * i,), generator=gen).tolist() for i in range(12)]
    alone = Engine(EngineConfig(model=tiny_v2, dtype="float32", enable_prefix_cache=False, progress=False))
    expected = {f"r{i}": run(alone, {f"r{i}": p})[f"r{i}"][0] for i, p in enumerate(prompts)}
    engine = Engine(EngineConfig(model=tiny_v2, dtype="float32", page_size=PAGE_SIZE, num_pages=12, progress=False,
                                 host_kv_cache_gib=0.05, overlap_scheduling=overlap))
    made: dict[str, list[int]] = {}
    for wave in range(0, 12, 3):  # four waves of three at once (preempting), each after the last one's are cached
        made.update({rid: tokens for rid, (tokens, _) in run(engine, {
            f"r{i}": prompts[i] for i in range(wave, wave + 3)}).items()})
    assert made == expected
    host = engine.prefix_cache.host_tier
    assert host.loaded_pages > 0 and host.offloaded_pages > 0
    engine.prefix_cache.check_integrity()
    assert engine.allocator.num_free + engine.prefix_cache.num_cached_pages == engine.allocator.num_pages
