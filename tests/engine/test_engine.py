"""Engine behaviour on a tiny model: caching, chunking, preemption and batching never change greedy tokens;
sampling, stops and limits end generation where they should."""

from dataclasses import replace

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.engine import InvalidRequestError
from pdserve.engine.request import Request

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts_of(lengths, vocab=512, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_v3):
    """Greedy tokens for a mixed batch, one prompt at a time, no prefix cache, no chunking."""
    prompts = prompts_of((3, 40, 77, 150, 201))
    llm = LLM(tiny_v3, progress=False, enable_prefix_cache=False)
    return prompts, [llm.generate(prompt_token_ids=[p], sampling=GREEDY)[0].token_ids for p in prompts]


def test_batch_gives_same_tokens_as_one_at_a_time(tiny_v3, reference):
    prompts, expected = reference
    results = LLM(tiny_v3, progress=False, enable_prefix_cache=False).generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [r.token_ids for r in results] == expected


def test_prefix_hit_gives_same_tokens_as_miss(tiny_v3, reference):
    prompts, expected = reference
    llm = LLM(tiny_v3, progress=False)
    first = llm.generate(prompt_token_ids=prompts, sampling=GREEDY)
    second = llm.generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [r.token_ids for r in first] == [r.token_ids for r in second] == expected
    assert sum(r.cached_tokens for r in first) == 0
    assert [r.cached_tokens for r in second] == [(len(p) - 1) // 16 * 16 for p in prompts]


def test_chunked_prefill_with_small_budget_gives_same_tokens(tiny_v3, reference):
    prompts, expected = reference
    llm = LLM(tiny_v3, progress=False, max_num_batched_tokens=13)
    assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected



def test_prefill_chunks_capped_beside_decodes_give_same_tokens(tiny_v3, reference):
    prompts, expected = reference
    llm = LLM(tiny_v3, progress=False, max_num_batched_tokens=64, mixed_prefill_tokens=7)
    assert [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling=GREEDY)] == expected

def test_preemption_in_a_small_pool_gives_same_tokens_and_frees_every_page(tiny_v3, reference):
    prompts, expected = reference
    llm = LLM(tiny_v3, progress=False, num_pages=16, page_size=16)  # 256 slots, the batch needs ~600
    results = llm.generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert [r.token_ids for r in results] == expected
    engine = llm.engine
    assert engine.allocator.num_free + engine.prefix_cache.num_cached_pages == engine.allocator.num_pages
    engine.prefix_cache.evict(engine.allocator.num_pages)
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_prefixes_evicted_to_the_host_tier_come_back_as_hits_with_the_same_tokens(tiny_v3, reference):
    prompts, expected = reference
    llm = LLM(tiny_v3, progress=False, num_pages=16, page_size=16, host_kv_cache_gib=0.25)
    batched = llm.generate(prompt_token_ids=prompts, sampling=GREEDY)  # preempts: the pool holds one sequence
    one_at_a_time = [llm.generate(prompt_token_ids=[p], sampling=GREEDY)[0] for p in prompts]
    host = llm.engine.prefix_cache.host_tier
    # Each prompt's pages were evicted by the next ones' and now come back from the host instead of recomputed.
    assert [r.cached_tokens for r in one_at_a_time] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert host.loaded_pages >= sum((len(p) - 1) // 16 for p in prompts[1:])
    assert [r.token_ids for r in batched] == [r.token_ids for r in one_at_a_time] == expected
    stats = llm.engine.stats()
    assert (stats.host_cache_loaded_pages, stats.host_cache_pages) == (host.loaded_pages, host.num_pages) != (0, 0)
    llm.engine.prefix_cache.check_integrity()


def test_preemption_happens_in_a_small_pool(tiny_v3):
    llm = LLM(tiny_v3, progress=False, num_pages=16, page_size=16, enable_prefix_cache=False)
    engine = llm.engine
    for i, prompt in enumerate(prompts_of((60, 60, 60))):  # 4 pages each to start, 6 at the end
        engine.add_request(str(i), prompt, GREEDY)
    preempted = 0
    for _ in range(500):
        if not engine.has_work():
            break
        engine.step()
        preempted = max(preempted, sum(r.num_preemptions for r in engine.requests.values()))
    assert not engine.has_work()
    assert preempted > 0
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_v2):
    llm = LLM(tiny_v2, progress=False)
    prompt = prompts_of((20,))[0]
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    a, b, c = llm.generate(prompt_token_ids=[prompt] * 3, sampling=params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    again = llm.generate(prompt_token_ids=[prompt], sampling=params[0])[0]
    assert again.token_ids == a.token_ids


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_migrated_stream_draws_and_is_penalized_as_an_undisturbed_one(tiny_v2, cut):
    """A stream continued on another worker (prompt + what was streamed, continued_tokens): a seeded draw skips the
    streamed tokens' draws and the penalties count them as output, so the rest is the undisturbed run's."""
    llm = LLM(tiny_v2, progress=False)
    prompt = prompts_of((20,))[0]
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=9, presence_penalty=1.5, frequency_penalty=1.0,
                              ignore_eos=True)
    whole = llm.generate(prompt_token_ids=[prompt], sampling=sampling)[0].token_ids
    streamed = whole[:cut]
    rest = llm.generate(prompt_token_ids=[prompt + streamed], sampling=replace(
        sampling, max_tokens=16 - cut, continued_tokens=cut))[0].token_ids
    assert streamed + rest == whole
    as_prompt = llm.generate(prompt_token_ids=[prompt + streamed], sampling=replace(sampling, max_tokens=16 - cut))[0]
    assert streamed + as_prompt.token_ids != whole  # without it the continuation is another sample


def test_continued_tokens_must_leave_a_prompt(tiny_v2):
    with pytest.raises(InvalidRequestError, match="continued_tokens"):
        LLM(tiny_v2, progress=False).generate(prompt_token_ids=[[5, 6, 7]], sampling=replace(GREEDY, continued_tokens=3))


def test_stop_token_id_ends_generation_on_that_token(tiny_v2):
    llm = LLM(tiny_v2, progress=False)
    prompt = prompts_of((10,))[0]
    free = llm.generate(prompt_token_ids=[prompt], sampling=GREEDY)[0].token_ids
    stop_id = free[5]
    first = free.index(stop_id)
    stopped = llm.generate(prompt_token_ids=[prompt],
                           sampling=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[stop_id]))[0]
    assert stopped.token_ids == free[: first + 1]
    assert stopped.finish_reason == "stop"


def test_stop_string_cuts_text_before_it(tiny_v2):
    llm = LLM(tiny_v2, progress=False)
    free = llm.generate(prompts=["The quick brown fox"], sampling=GREEDY)[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    stopped = llm.generate(prompts=["The quick brown fox"],
                           sampling=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert len(stopped.token_ids) < len(free.token_ids)


def test_max_tokens_and_min_tokens_bound_the_output(tiny_v2):
    llm = LLM(tiny_v2, progress=False)
    eos = llm.engine.model_config.eos_token_ids[0]
    prompt = prompts_of((10,))[0]
    out = llm.generate(prompt_token_ids=[prompt], sampling=SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert len(out.token_ids) <= 5
    forced = llm.generate(prompt_token_ids=[prompt], sampling=SamplingParams(
        max_tokens=12, min_tokens=12, temperature=0.0, stop_token_ids=[eos]))[0]
    assert len(forced.token_ids) == 12 and eos not in forced.token_ids and forced.finish_reason == "length"


def test_logprobs_are_returned_for_each_token(tiny_v2):
    llm = LLM(tiny_v2, progress=False)
    out = llm.generate(prompt_token_ids=prompts_of((8,)), sampling=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    assert len(out.logprobs) == 6 and all(lp <= 0.0 for lp in out.logprobs)


def test_queued_prompt_tokens_count_what_is_left_to_prefill(tiny_v2):
    """What a rank reports for the router to tell how long its prefill queue takes (conditional disaggregation)."""
    llm = LLM(tiny_v2, progress=False, enable_prefix_cache=False, max_num_batched_tokens=32)
    engine = llm.engine
    for i, prompt in enumerate(prompts_of((50, 20))):
        engine.add_request(str(i), prompt, GREEDY)
    assert engine.stats().queued_prompt_tokens == 70
    engine.step()  # a 32-token chunk of the first prompt
    assert engine.stats().queued_prompt_tokens == 38
    while engine.stats().queued_prompt_tokens:
        engine.step()
    assert engine.has_work()  # decoding: no prompt left to compute


def test_abort_frees_the_request_pages(tiny_v2):
    llm = LLM(tiny_v2, progress=False, enable_prefix_cache=False)
    engine = llm.engine
    engine.add_request("a", prompts_of((50,))[0], GREEDY)
    engine.step()
    assert engine.allocator.num_free < engine.allocator.num_pages
    assert engine.abort("a")
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert not engine.has_work()


@pytest.mark.parametrize("bad, message", [
    ([], "empty"), ([10**6], "vocabulary"), ([5] * 5000, "context"),
])
def test_bad_prompts_are_rejected_with_a_clear_error(tiny_v2, bad, message):
    llm = LLM(tiny_v2, progress=False, max_model_len=4096)
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt_token_ids=[bad], sampling=GREEDY)


def test_request_larger_than_the_pool_is_rejected(tiny_v2):
    llm = LLM(tiny_v2, progress=False, num_pages=4, page_size=16)
    with pytest.raises(InvalidRequestError, match="KV pool"):
        llm.generate(prompt_token_ids=prompts_of((60,)), sampling=GREEDY)


def test_a_requests_known_tokens_in_any_range_are_the_slice_of_all_its_tokens():
    """The runner's per-step read (known_token_ids) against the joined list it replaced, over every range that
    starts and ends in the prompt, across it, in the output, and past the known tokens."""
    request = Request("r", [10, 11, 12, 13], SamplingParams(max_tokens=8), torch.Generator(),
                      output_token_ids=[20, 21, 22])
    for start in range(9):
        for end in range(start, 10):
            assert request.known_token_ids(start, end) == request.all_token_ids[start:end], (start, end)


def first_outputs(llm: LLM, prompts: list[list[int]], sampling: SamplingParams) -> dict[str, list]:
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"p{index}", prompt, sampling)
    outputs: dict[str, list] = {}
    while engine.has_work():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_prompt_logprobs_are_the_same_chunked_preempted_or_after_a_cache_hit(tiny_v3, reference):
    prompts, _ = reference
    sampling = replace(GREEDY, max_tokens=6, prompt_logprobs=3)
    whole = first_outputs(LLM(tiny_v3, progress=False, enable_prefix_cache=False), prompts, sampling)
    for options in (dict(max_num_batched_tokens=13), dict(num_pages=16, page_size=16)):  # chunks; preemption
        llm = LLM(tiny_v3, progress=False, **options)
        llm.generate(prompt_token_ids=prompts, sampling=GREEDY)  # the prompts' pages now in the prefix cache
        outputs = first_outputs(llm, prompts, sampling)
        for request_id, prompt in zip(sorted(whole), prompts):
            first, *rest = outputs[request_id]
            expected = whole[request_id][0].prompt_logprobs
            assert len(first.prompt_logprobs) == len(prompt) and first.prompt_logprobs[0] is None
            assert [p.logprob for p in first.prompt_logprobs[1:]] == pytest.approx(
                [p.logprob for p in expected[1:]], abs=1e-4)
            assert [p.top_token_ids for p in first.prompt_logprobs[1:]] == [p.top_token_ids for p in expected[1:]]
            assert all(len(p.top_token_ids) == 3 for p in first.prompt_logprobs[1:])
            assert all(output.prompt_logprobs is None for output in rest)
            assert first.cached_tokens == 0
    offline = LLM(tiny_v3, progress=False).generate(prompt_token_ids=prompts[:1], sampling=sampling)[0]
    assert [p.logprob for p in offline.prompt_logprobs[1:]] == pytest.approx(
        [p.logprob for p in whole["p0"][0].prompt_logprobs[1:]], abs=1e-4)  # LLM.generate's results carry them
