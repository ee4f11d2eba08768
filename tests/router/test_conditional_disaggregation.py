"""Conditional disaggregation through a real router, prefill worker and decode worker: a prompt within
`--local-prefill-max-tokens` is prefilled on the decode worker (the prefill worker never sees it), a longer one takes
the P/D path, and both give the offline engine's greedy tokens."""

import pytest
import torch
from probes import HTTP, internal_headers, metric_total

from pdserve import LLM, SamplingParams
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.engine.config import EngineConfig

MAX_LOCAL_TOKENS = 32
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1,
                        worker_args=("--dtype", "float32", "--num-pages", "128"),
                        router_args=("--local-prefill-max-tokens", str(MAX_LOCAL_TOKENS), "--local-prefill-min-queue", "0"))
    with InProcessCluster(cfg) as running:
        yield running


def test_short_prompts_prefill_on_the_decode_worker_and_long_ones_on_the_prefill_worker(cluster, tiny_v2):
    prefill = next(w for w in cluster.workers if w.name.startswith("prefill"))
    gen = torch.Generator().manual_seed(5)
    short, long = (torch.randint(2, 400, (n,), generator=gen).tolist() for n in (MAX_LOCAL_TOKENS, MAX_LOCAL_TOKENS + 1))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in LLM(tiny_v2, progress=False, dtype="float32").generate(
        prompt_token_ids=[short, long], sampling=greedy)]
    model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]

    def complete(prompt: list[int]) -> list[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        response = HTTP.post(cluster.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    prefill_prompt_tokens = metric_total(prefill.url, "pdserve_prompt_tokens_total")
    assert complete(short) == expected[0]
    assert metric_total(cluster.url, "pdserve_router_local_prefills_total") == 1
    assert metric_total(prefill.url, "pdserve_prompt_tokens_total") == prefill_prompt_tokens

    assert complete(long) == expected[1]
    assert metric_total(cluster.url, "pdserve_router_local_prefills_total") == 1
    assert metric_total(prefill.url, "pdserve_prompt_tokens_total") == prefill_prompt_tokens + len(long)
    # What the rule reads: the prefill rank measured its prefill speed, and has no prompt left to compute.
    rank = HTTP.get(prefill.url + "/internal/v1/load", headers=internal_headers(), timeout=TIMEOUT_S).json()["ranks"][0]
    assert rank["prefill_tokens_per_s"] > 0 and rank["queued_prompt_tokens"] == 0
    # ...and the decode rank tells the most prompt tokens its steps compute beside decodes (the engine's budget here)
    decode = next(w for w in cluster.workers if w.name.startswith("decode"))
    info = HTTP.get(decode.url + "/internal/v1/info", headers=internal_headers(), timeout=TIMEOUT_S).json()
    assert info["ranks"][0]["prefill_chunk_tokens"] == EngineConfig(model=tiny_v2).max_num_batched_tokens
