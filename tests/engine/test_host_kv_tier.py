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
