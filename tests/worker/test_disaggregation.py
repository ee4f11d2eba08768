"""Prefill worker -> NIXL -> decode worker gives the same tokens as a colocated worker and the offline engine,
with real processes and real KV bytes; pages are back to baseline afterwards."""

import time

import pytest
import torch
from probes import metric_total
from worker_calls import disaggregated, generate, pages_at_rest, token_ids

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def worker(cluster, role: str):
    return next(w for w in cluster.workers if w.name.startswith(role))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 64, 200)]


@pytest.fixture(scope="module")
def offline_tokens(tiny_v2, prompts):
    llm = LLM(tiny_v2, progress=False, dtype="float32")
    return [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling=GREEDY)]


def test_disaggregated_tokens_equal_colocated_and_offline(pd_cluster, prompts, offline_tokens):
    prefill, decode, both = (worker(pd_cluster, r).url for r in ("prefill", "decode", "both"))
    for prompt, expected in zip(prompts, offline_tokens):
        events = disaggregated(decode, prefill, prompt, GREEDY)
        assert events[-1].finish_reason == "length", events[-1].error
        assert token_ids(events) == expected
        assert token_ids(generate(both, prompt, GREEDY)) == expected


def test_prefix_hits_on_the_prefill_side_keep_tokens_identical(pd_cluster, prompts, offline_tokens):
    prefill, decode = worker(pd_cluster, "prefill").url, worker(pd_cluster, "decode").url
    prompt, expected = prompts[-1], offline_tokens[-1]
    disaggregated(decode, prefill, prompt, GREEDY)
    again = disaggregated(decode, prefill, prompt, GREEDY)
    assert again[0].cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert token_ids(again) == expected


def test_pages_return_to_baseline_on_both_sides(pd_cluster, prompts):
    prefill, decode = worker(pd_cluster, "prefill").url, worker(pd_cluster, "decode").url
    for prompt in prompts[:3]:
        disaggregated(decode, prefill, prompt, GREEDY)
    deadline = time.monotonic() + 10
    while not (pages_at_rest(prefill) and pages_at_rest(decode)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pages_at_rest(prefill) and pages_at_rest(decode)


def test_prompt_and_output_tokens_are_counted_once_over_both_workers(pd_cluster, prompts):
    urls = [worker(pd_cluster, r).url for r in ("prefill", "decode")]
    names = ("pdserve_prompt_tokens_total", "pdserve_generation_tokens_total")
    before = {name: sum(metric_total(url, name) for url in urls) for name in names}
    prompt = prompts[-2]
    events = disaggregated(urls[1], urls[0], prompt, GREEDY)
    assert events[-1].finish_reason == "length"
    counted = {name: sum(metric_total(url, name) for url in urls) - before[name] for name in names}
    assert counted == {"pdserve_prompt_tokens_total": len(prompt), "pdserve_generation_tokens_total": GREEDY.max_tokens}


def test_plan_for_the_wrong_role_is_refused(pd_cluster, prompts):
    prefill = worker(pd_cluster, "prefill").url
    with pytest.raises(Exception, match="400"):
        disaggregated(prefill, prefill, prompts[0], GREEDY)
