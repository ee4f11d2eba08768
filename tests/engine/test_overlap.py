"""Overlapped scheduling (the next step prepared while this one runs, sampled tokens kept on the device) gives exactly
the tokens, log-probabilities and finish reasons of synchronous steps: with chunked prefill, preemption, stops seen
one step late, aborts in flight, requests arriving mid-run, penalties and grammars (stepped synchronously), and a
prefill/decode hand-off. On the CPU nothing runs concurrently, but the delayed detection, the device-resident input
ids and the discarded extra token are the same code as on a GPU; the GPU test at the end adds CUDA graphs."""

from collections import defaultdict
from dataclasses import dataclass, field, replace

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cache.page_allocator import pages_for
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine, NoCapacityError, RequestOutput
from pdserve.text.grammars import json_schema_source
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.sampling import Grammar
from tests.engine.test_cuda_graphs import FLASHINFER_SHAPE

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts_of(lengths, vocab=500, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class Arrival:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    after: tuple[str, int] | None = None  # added once that request has emitted that many tokens or ended (None: at
    # once)


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    logprobs: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    top_token_ids: dict[str, list[list[int]]] = field(default_factory=lambda: defaultdict(list))
    top_logprobs: dict[str, list[list[float]]] = field(default_factory=lambda: defaultdict(list))
    text: dict[str, str] = field(default_factory=lambda: defaultdict(str))
    finish_reasons: dict[str, str] = field(default_factory=dict)
    max_preemptions: int = 0
    decode_rows: int = 0  # sequences computed one token past a sampled one, over all steps

    def take(self, out: RequestOutput) -> None:
        assert out.request_id not in self.finish_reasons, f"{out.request_id} emitted after its end"
        self.tokens[out.request_id].extend(out.new_token_ids)
        self.logprobs[out.request_id].extend(out.new_logprobs or [])
        self.top_token_ids[out.request_id].extend(out.new_top_token_ids or [])
        self.top_logprobs[out.request_id].extend(out.new_top_logprobs or [])
        self.text[out.request_id] += out.text
        if out.finish_reason is not None:
            self.finish_reasons[out.request_id] = out.finish_reason


def drive(engine: Engine, arrivals: list[Arrival], abort_after: dict[str, int] | None = None,
          max_steps: int = 2000) -> Run:
    """Steps `engine` until every request has ended; `abort_after`: request id -> aborted once it has emitted that
    many tokens."""
    run, pending, abort_after = Run(), list(arrivals), dict(abort_after or {})
    for _ in range(max_steps):
        for arrival in [a for a in pending if a.after is None or len(run.tokens[a.after[0]]) >= a.after[1]
                        or a.after[0] in run.finish_reasons]:
            engine.add_request(arrival.request_id, arrival.prompt, arrival.sampling)
            pending.remove(arrival)
        if not engine.has_work() and not pending:
            return run
        for out in engine.step():
            run.take(out)
        run.decode_rows += engine.last_step.decode_batch
        run.max_preemptions = max(run.max_preemptions, sum(r.num_preemptions for r in engine.requests.values()))
        for request_id, count in list(abort_after.items()):
            if len(run.tokens[request_id]) >= count and request_id not in run.finish_reasons:
                assert engine.abort(request_id)
                run.finish_reasons[request_id] = "abort"
                del abort_after[request_id]
    raise AssertionError(f"not done after {max_steps} steps")


def engine_for(model: str, overlap: bool, **options) -> Engine:
    return Engine(EngineConfig(model=model, dtype="float32", device="cpu", progress=False,
                               overlap_scheduling="on" if overlap else "off", **options))


def assert_every_page_free(engine: Engine) -> None:
    assert engine.allocator.num_free + engine.prefix_cache.num_cached_pages == engine.allocator.num_pages
    engine.prefix_cache.evict(engine.allocator.num_pages)
    assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.fixture(scope="module")
def mixed_batch(tiny_v3):
    """Requests of every kind of end, some arriving mid-run, their stops taken from a free (unstopped) run."""
    prompts = prompts_of((3, 40, 77, 20, 150, 201, 33, 9, 60))
    free = LLM(tiny_v3, progress=False).generate(prompt_token_ids=prompts, sampling=GREEDY)
    stop_text = free[2].text[4:7]
    assert stop_text and free[2].text.index(stop_text) < len(free[2].text) - 3
    arrivals = [
        Arrival("short", prompts[0], replace(GREEDY, max_tokens=5)),
        Arrival("stop-token", prompts[1], replace(GREEDY, stop_token_ids=[free[1].token_ids[6]])),
        Arrival("stop-string", prompts[2], replace(GREEDY, stop=[stop_text])),
        # its stop token comes early, banned until min_tokens
        Arrival("min-tokens", prompts[3], replace(GREEDY, min_tokens=8, stop_token_ids=[free[3].token_ids[1]])),
        Arrival("aborted", prompts[4], GREEDY),
        Arrival("late", prompts[5], replace(GREEDY, max_tokens=11), after=("short", 2)),
        Arrival("logprobs", prompts[6], replace(GREEDY, max_tokens=9, logprobs=True, top_logprobs=3)),
        Arrival("seeded", prompts[7], SamplingParams(max_tokens=14, temperature=1.0, top_p=0.9, seed=7,
                                                     ignore_eos=True), after=("stop-token", 3)),
        Arrival("one-token", prompts[8], replace(GREEDY, max_tokens=1), after=("late", 1)),
    ]
    return arrivals, {"aborted": 4}


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 13},  # every prompt in chunks, decodes beside them
    {"num_pages": 16, "page_size": 16},  # the longest request alone needs 15 pages
    {"enable_prefix_cache": False, "max_num_seqs": 3},
], ids=["plain", "chunked-prefill", "small-pool", "no-prefix-cache-3-seqs"])
def test_overlapped_steps_give_the_synchronous_tokens_and_finish_reasons(tiny_v3, mixed_batch, options):
    arrivals, abort_after = mixed_batch
    runs = {}
    for overlap in (False, True):
        engine = engine_for(tiny_v3, overlap, **options)
        runs[overlap] = drive(engine, arrivals, abort_after)
        assert_every_page_free(engine)
    sync, overlapped = runs[False], runs[True]
    assert dict(overlapped.tokens) == dict(sync.tokens)
    assert overlapped.finish_reasons == sync.finish_reasons
    assert dict(overlapped.text) == dict(sync.text)
    assert dict(overlapped.top_token_ids) == dict(sync.top_token_ids)
    assert overlapped.logprobs["logprobs"] == pytest.approx(sync.logprobs["logprobs"], abs=1e-5)
    assert sync.finish_reasons == {"short": "length", "stop-token": "stop", "stop-string": "stop",
                                   "min-tokens": sync.finish_reasons["min-tokens"], "aborted": "abort",
                                   "late": "length", "logprobs": "length", "seeded": "length", "one-token": "length"}
    assert len(sync.tokens["min-tokens"]) >= 8 and len(sync.tokens["aborted"]) == 4


def test_preemption_with_tokens_in_flight_gives_the_synchronous_tokens(tiny_v3):
    prompts = prompts_of((3, 40, 77, 20, 150, 201, 33, 9, 60))
    arrivals = [Arrival(str(i), prompt, GREEDY) for i, prompt in enumerate(prompts)]
    runs = {}
    for overlap in (False, True):
        engine = engine_for(tiny_v3, overlap, num_pages=16, page_size=16)  # the longest request alone needs 15
        runs[overlap] = drive(engine, arrivals)
        assert runs[overlap].max_preemptions > 0
        assert_every_page_free(engine)
    assert dict(runs[True].tokens) == dict(runs[False].tokens)


def test_a_stop_token_is_seen_one_step_late_and_the_extra_token_is_dropped(tiny_v2):
    prompt = prompts_of((10,))[0]
    free = drive(engine_for(tiny_v2, False), [Arrival("r", prompt, GREEDY)]).tokens["r"]
    stop_id = free[5]
    expected = free[: free.index(stop_id) + 1]
    arrivals = [Arrival("r", prompt, replace(GREEDY, stop_token_ids=[stop_id]))]
    sync = drive(engine_for(tiny_v2, False), arrivals)
    engine = engine_for(tiny_v2, True)
    overlapped = drive(engine, arrivals)
    assert overlapped.tokens["r"] == sync.tokens["r"] == expected
    assert overlapped.finish_reasons == {"r": "stop"}
    # Synchronous steps compute a token past each sampled one but the last; overlapped ones also past the last.
    assert sync.decode_rows == len(expected) - 1
    assert overlapped.decode_rows == len(expected)
    assert_every_page_free(engine)


def test_a_length_end_is_not_computed_past(tiny_v2):
    engine = engine_for(tiny_v2, True)
    run = drive(engine, [Arrival("r", prompts_of((10,))[0], replace(GREEDY, max_tokens=5))])
    assert len(run.tokens["r"]) == 5 and run.finish_reasons == {"r": "length"}
    assert run.decode_rows == 4


def test_a_step_whose_requests_all_end_on_their_length_is_read_at_once(tiny_v2):
    engine = engine_for(tiny_v2, True)
    engine.add_request("r", prompts_of((10,))[0], replace(GREEDY, max_tokens=1))
    (out,) = engine.step()  # nothing to prepare meanwhile: no call later to wait for
    assert out.finish_reason == "length" and not engine.has_work()


def test_aborting_a_request_in_flight_discards_its_token_and_frees_its_pages(tiny_v2):
    prompts = prompts_of((30, 50))
    sync = drive(engine_for(tiny_v2, False), [Arrival("a", prompts[0], GREEDY), Arrival("b", prompts[1], GREEDY)])
    engine = engine_for(tiny_v2, True, enable_prefix_cache=False)
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    emitted = defaultdict(list)
    while len(emitted["a"]) < 3:
        for out in engine.step():
            emitted[out.request_id].extend(out.new_token_ids)
    assert engine.requests["a"].num_unresolved_tokens == 1  # its next token is in flight
    assert engine.abort("a")
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == "b"
            emitted["b"].extend(out.new_token_ids)
    assert emitted["a"] == sync.tokens["a"][:3]
    assert emitted["b"] == sync.tokens["b"]
    assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 1.3}, {"frequency_penalty": 0.8}, {"presence_penalty": 0.5},
])
def test_penalized_requests_step_synchronously_and_give_the_synchronous_tokens(tiny_v2, penalty):
    prompts = prompts_of((12, 25, 7))
    arrivals = [Arrival("plain", prompts[0], GREEDY),
                Arrival("penalized", prompts[1], replace(GREEDY, max_tokens=16, **penalty)),
                Arrival("after", prompts[2], GREEDY, after=("penalized", 16))]
    sync = drive(engine_for(tiny_v2, False), arrivals)
    overlapped = drive(engine_for(tiny_v2, True), arrivals)
    assert dict(overlapped.tokens) == dict(sync.tokens)
    free = drive(engine_for(tiny_v2, False), [Arrival("penalized", prompts[1], replace(GREEDY, max_tokens=16))])
    assert free.tokens["penalized"] != sync.tokens["penalized"]  # the penalty did change the tokens


def test_a_batch_with_a_penalized_request_leaves_nothing_in_flight(tiny_v2):
    engine = engine_for(tiny_v2, True)
    engine.add_request("plain", prompts_of((12,))[0], GREEDY)
    engine.step()
    assert engine.requests["plain"].num_unresolved_tokens == 1
    engine.add_request("penalized", prompts_of((8,))[0], replace(GREEDY, repetition_penalty=1.2))
    outputs = engine.step()  # both tokens of "plain" so far, and the first of "penalized"
    assert [(o.request_id, len(o.new_token_ids)) for o in outputs] == [("plain", 1), ("plain", 1), ("penalized", 1)]
    assert all(r.num_unresolved_tokens == 0 for r in engine.requests.values())


def test_grammar_constrained_requests_give_the_synchronous_text(tiny_v3_deepseek):
    schema = {"type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rain"]}}, "required": ["sky"],
              "additionalProperties": False}
    grammar = Grammar("json_schema", json_schema_source(schema))
    tokenizer = PromptTokenizer(tiny_v3_deepseek)
    prompts = [tokenizer.encode(text) for text in ("Weather?", "0 1 2 3 4 5", "Answer in JSON:")]
    arrivals = [Arrival("free", prompts[0], replace(GREEDY, max_tokens=12)),
                Arrival("json", prompts[1], SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)),
                Arrival("late", prompts[2], replace(GREEDY, max_tokens=6), after=("json", 2))]
    sync = drive(engine_for(tiny_v3_deepseek, False), arrivals)
    overlapped = drive(engine_for(tiny_v3_deepseek, True), arrivals)
    assert dict(overlapped.tokens) == dict(sync.tokens)
    assert overlapped.text["json"] == sync.text["json"] and sync.finish_reasons["json"] == "stop"
    assert overlapped.finish_reasons == sync.finish_reasons


def test_prefill_only_and_start_decoding_overlapped_give_the_colocated_tokens(tiny_v2):
    prompt = prompts_of((40,))[0]
    sampling = replace(GREEDY, max_tokens=10)
    colocated = drive(engine_for(tiny_v2, False, page_size=16), [Arrival("r", prompt, sampling)]).tokens["r"]
    prefill = engine_for(tiny_v2, True, page_size=16)
    decode = engine_for(tiny_v2, True, page_size=16)
    prefill.add_prefill_only("r", prompt, sampling)
    outputs = []
    while not outputs:
        outputs = prefill.step()
    (first,) = outputs
    assert first.finish_reason == "length" and first.new_token_ids == colocated[:1]
    assert not prefill.has_work()
    kept = prefill.requests["r"].page_ids
    assert len(kept) == pages_for(len(prompt), 16)
    reserved = decode.reserve("r", prompt, sampling).page_ids
    decode.runner.kv_cache[:, reserved] = prefill.runner.kv_cache[:, kept]  # what the KV transfer does
    prefill.release("r")
    assert prefill.allocator.num_free + prefill.prefix_cache.num_cached_pages == prefill.allocator.num_pages
    tokens = decode.start_decoding("r", RequestOutput("r", first.new_token_ids, None)).new_token_ids
    while decode.has_work():
        tokens += [t for out in decode.step() for t in out.new_token_ids]
    assert tokens == colocated


def test_a_decode_rank_reserves_for_at_most_max_num_seqs_sequences(tiny_v2):
    """Reserved and running sequences together stay within max_num_seqs, so a P/D decode batch never outgrows the
    largest captured graph; a slot frees when a sequence ends."""
    decode = engine_for(tiny_v2, True, page_size=16, max_num_seqs=2)
    prompt, sampling = prompts_of((20,))[0], replace(GREEDY, max_tokens=2)
    decode.reserve("a", prompt, sampling)
    decode.start_decoding("a", RequestOutput("a", [5], None))
    decode.reserve("b", prompt, sampling)
    with pytest.raises(NoCapacityError, match="2 sequence slots"):
        decode.reserve("c", prompt, sampling)
    assert "c" not in decode.requests
    while "a" in decode.requests:  # "a" ends on its length
        decode.step()
    assert decode.reserve("c", prompt, sampling).page_ids


@pytest.mark.parametrize("reserve_tokens", [32, 0])
def test_a_decode_rank_keeps_pages_for_its_sequences_next_tokens_before_it_reserves_more(tiny_v2, reserve_tokens):
    """A new prompt's pages are reserved only while the held sequences' next tokens (up to decode_reserve_tokens
    each) still fit, so the running sequence is never preempted to make room; 0 reserves whatever is free."""
    decode = engine_for(tiny_v2, True, page_size=16, num_pages=8, decode_reserve_tokens=reserve_tokens)
    sampling = replace(GREEDY, max_tokens=40)
    decode.reserve("a", prompts_of((20,))[0], sampling)  # 2 pages; 52 tokens after 32 more: 4
    decode.start_decoding("a", RequestOutput("a", [5], None))
    running = decode.requests["a"]
    assert decode.stats().growth_pages == (2 if reserve_tokens else 0)
    five_pages, four_pages = prompts_of((65, 64), seed=6)
    if not reserve_tokens:
        assert decode.reserve("b", five_pages, sampling).page_ids  # leaves "a" one page to grow into, of two
        return
    with pytest.raises(NoCapacityError, match="next tokens"):
        decode.reserve("b", five_pages, sampling)
    assert "b" not in decode.requests
    decode.reserve("b", four_pages, sampling)
    assert decode.stats().growth_pages == 2 + 2  # "b", once decoding, takes two more pages for 32 tokens
    for _ in range(100):
        if "a" not in decode.requests:
            break
        decode.step()
    assert "a" not in decode.requests
    assert running.num_preemptions == 0 and len(running.output_token_ids) == 40


def test_prefill_only_requests_keep_exactly_the_prompt_pages_when_the_prompt_fills_them(tiny_v2):
    prompt = prompts_of((32,))[0]  # two full pages: a decode past the prompt would have taken a third
    engine = engine_for(tiny_v2, True, page_size=16)
    engine.add_prefill_only("p", prompt, GREEDY)
    engine.add_request("other", prompts_of((5,))[0], GREEDY)
    finished = None
    while finished is None:
        finished = next((o for o in engine.step() if o.request_id == "p"), None)
    assert len(engine.requests["p"].page_ids) == 2 and len(finished.new_token_ids) == 1
    for _ in range(3):
        engine.step()
    assert len(engine.requests["p"].page_ids) == 2  # not scheduled again while it waits for its transfer


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def first_divergence(sync: Run, overlapped: Run, request_id: str) -> int | None:
    pairs = zip(sync.tokens[request_id], overlapped.tokens[request_id])
    return next((i for i, (a, b) in enumerate(pairs) if a != b), None)


# The logits are rounded to bf16 before the float32 softmax: two candidates one or two bf16 steps apart at a logit
# magnitude of 16-32 (0.125 a step) are a near tie that rounding of the hidden state can flip.
BF16_LOGIT_STEPS = 0.25


def assert_divergences_are_near_ties(sync: Run, overlapped: Run) -> list[tuple[str, int, float]]:
    """bf16 kernels may round a row differently by the step it runs in, and two runs whose steps differ in shape
    may then pick different greedy tokens where two candidates' logits nearly tie (bf16 logits tie exactly quite
    often). A request may diverge only there: at its first differing position each run's choice is among the
    other's top two, and the margins by which each run preferred its own choice sum to no more than the rounding
    noise seen between the runs on the positions before (the chosen token's log-probability, run against run) plus
    two bf16 steps of the logits. A wrong input token (a logic error) gives no such near tie. Returns (request,
    position, summed margins) of every divergence."""
    agreed = {rid: first_divergence(sync, overlapped, rid) for rid in sync.tokens}  # positions before it agree
    noise = [abs(a - b) for rid, end in agreed.items()
             for a, b in list(zip(sync.logprobs[rid], overlapped.logprobs[rid]))[:end]]
    tolerance = 4 * max(noise, default=0.0) + BF16_LOGIT_STEPS
    found = []
    for rid, i in agreed.items():
        if i is None:
            assert len(overlapped.tokens[rid]) == len(sync.tokens[rid]), rid
            continue
        ours, theirs = sync.tokens[rid][i], overlapped.tokens[rid][i]

        def margin(run: Run, chosen: int, other: int) -> float:
            top = dict(zip(run.top_token_ids[rid][i], run.top_logprobs[rid][i]))
            assert other in top, f"{rid} diverges at {i}: {other} is not among the top tokens {top}"
            return top[chosen] - top[other]

        margins = margin(sync, ours, theirs) + margin(overlapped, theirs, ours)
        assert margins <= tolerance, f"{rid} diverges at {i} with margins {margins:.4f} > {tolerance:.4f}"
        found.append((rid, i, margins))
    return found


def run_of(tokens: list[int], logprobs: list[float], tops: list[tuple[list[int], list[float]]]) -> Run:
    run = Run()
    run.tokens["r"], run.logprobs["r"] = tokens, logprobs
    run.top_token_ids["r"], run.top_logprobs["r"] = [t for t, _ in tops], [lp for _, lp in tops]
    return run


def test_only_a_near_tie_may_make_two_runs_diverge():
    sync = run_of([5, 6], [-1.0, -0.70], [([5, 9], [-1.0, -2.0]), ([6, 8], [-0.70, -0.703])])
    tied = run_of([5, 8], [-1.002, -0.705], [([5, 9], [-1.002, -2.0]), ([8, 6], [-0.705, -0.707])])
    assert assert_divergences_are_near_ties(sync, tied) == [("r", 1, pytest.approx(0.005))]
    wide = run_of([5, 8], [-1.002, -0.2], [([5, 9], [-1.002, -2.0]), ([8, 6], [-0.2, -0.9])])  # 0.703 apart
    with pytest.raises(AssertionError, match="margins"):
        assert_divergences_are_near_ties(sync, wide)
    # An exact tie, listed in top-k's order, not the chosen token first.
    exact_tie = run_of([5, 8], [-1.001, -0.70], [([5, 9], [-1.001, -2.0]), ([6, 8], [-0.70, -0.70])])
    assert assert_divergences_are_near_ties(sync, exact_tie) == [("r", 1, pytest.approx(0.003))]
    at_once = run_of([9], [-1.9], [([9, 5], [-1.9, -2.0])])  # diverges at its first token (0.1 + 0.1)
    assert assert_divergences_are_near_ties(run_of([5], [-1.0], [([5, 9], [-1.0, -1.1])]), at_once) == [
        ("r", 0, pytest.approx(0.2))]
    elsewhere = run_of([5, 4], [-1.002, -0.705], [([5, 9], [-1.002, -2.0]), ([4, 6], [-0.705, -0.708])])
    with pytest.raises(AssertionError, match="not among the top tokens"):
        assert_divergences_are_near_ties(sync, elsewhere)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("with_stops", [False, True], ids=["length-ends", "stop-tokens"])
@pytest.mark.parametrize("compile_eager_steps", [False, True], ids=["eager-steps", "compiled-eager-steps"])
def test_overlapped_graph_decode_gives_the_synchronous_tokens(tiny_model_factory, with_stops, compile_eager_steps):
    """Under CUDA graphs the carried input ids are copied into the graphs' static input buffer. Length ends keep
    both runs' batches identical; stop tokens add discarded rows, so batch sizes (and paddings) differ. Requests
    arriving mid-run join a step the overlapped host sees one step late, so the two runs' prefill and mixed steps
    differ in shape, and a row may round differently by step: compiled steps run inductor's bf16 kernels, and the
    shared experts run in the expert kernels' slots in steps of up to 16 tokens, as a dense MLP in larger ones
    (pdserve.model.deepseek.SHARED_SLOTS_MAX_TOKENS). Tokens may then differ where the logits nearly tie, and only
    there."""
    model = tiny_model_factory("v2", **FLASHINFER_SHAPE)
    prompts = prompts_of((3, 40, 77, 150, 201, 17))
    sampling = [replace(GREEDY, max_tokens=n, logprobs=True, top_logprobs=2) for n in (6, 9, 12, 15, 18, 21)]
    options = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, page_size=16, num_pages=128, cuda_graphs=True,
                   progress=False, compile_layers="on", compile_eager_steps=compile_eager_steps)
    free = [r.token_ids for r in LLM(model, **options).generate(prompt_token_ids=prompts, sampling=sampling)]
    if with_stops:
        sampling = [replace(s, stop_token_ids=[tokens[len(tokens) // 2]]) for s, tokens in zip(sampling, free)]
    arrivals = [Arrival(f"r{i}", p, s, after=None if i < 4 else ("r0", 2 * i - 6))
                for i, (p, s) in enumerate(zip(prompts, sampling))]
    runs = {}
    for overlap in (False, True):
        engine = Engine(EngineConfig(model=model, overlap_scheduling="on" if overlap else "off", **options))
        assert engine.runner.decode_graphs is not None
        runs[overlap] = drive(engine, arrivals, abort_after={"r3": 5})
        assert_every_page_free(engine)
    divergences = assert_divergences_are_near_ties(runs[False], runs[True])
    print("divergences (request, position, margins):", divergences)
    if not divergences:
        assert runs[True].finish_reasons == runs[False].finish_reasons
    if not with_stops:
        assert [len(runs[True].tokens[f"r{i}"]) for i in range(6)] == [6, 9, 12, 5, 18, 21]
