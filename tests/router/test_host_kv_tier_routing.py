"""The prefix cache's host tier through a real router, prefill worker and decode worker: a prompt whose pages the
prefill rank's small pool evicted comes back from host memory (the same greedy tokens, counted as cached and as
loaded pages), and the router still routes it as cached, since a page in either tier is held."""

import pytest
import torch
from probes import HTTP, eventually, metric_total

from pdserve import LLM, SamplingParams
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

TIMEOUT_S = 60.0
PAGE_SIZE = 16
POOL_PAGES = 16  # each rank's device pool: 256 tokens, two prompts' worth


@pytest.fixture(scope="module")
def cluster(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1,
                        worker_args=("--dtype", "float32", "--num-pages", str(POOL_PAGES),
                                     "--page-size", str(PAGE_SIZE), "--host-kv-cache-gib", "0.25"))
    with InProcessCluster(cfg) as running:
        yield running


def test_a_prompt_evicted_from_the_prefill_pool_comes_back_from_the_host_tier(cluster, tiny_v2):
    prefill = next(w for w in cluster.workers if w.name.startswith("prefill"))
    gen = torch.Generator().manual_seed(11)
    first, *others = (torch.randint(2, 400, (100,), generator=gen).tolist() for _ in range(5))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [expected] = [r.token_ids for r in LLM(tiny_v2, progress=False, dtype="float32").generate(
        prompt_token_ids=[first], sampling=greedy)]
    model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]

    def complete(prompt: list[int]) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        response = HTTP.post(cluster.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.json()

    assert complete(first)["choices"][0]["token_ids"] == expected
    for prompt in others:  # 4 x 6 pages through a 16-page pool: the first prompt's pages leave it
        complete(prompt)
    assert eventually(lambda: metric_total(prefill.url, "pdserve_host_kv_cache_offloaded_pages_total") >= 6)
    match_sum = metric_total(cluster.url, "pdserve_routed_prefix_match_ratio_sum")

    again = complete(first)
    assert again["choices"][0]["token_ids"] == expected
    cached = 99 // PAGE_SIZE * PAGE_SIZE  # whole pages of all but the last prompt token
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert eventually(lambda: metric_total(prefill.url, "pdserve_host_kv_cache_loaded_pages_total") == cached // PAGE_SIZE)
    assert metric_total(prefill.url, "pdserve_host_kv_cache_pages") >= 6
    # The router saw no page of the first prompt removed (they only moved to the host tier), so it matched them all.
    assert metric_total(cluster.url, "pdserve_routed_prefix_match_ratio_sum") - match_sum == pytest.approx(96 / 100)
