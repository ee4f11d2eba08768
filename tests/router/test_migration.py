"""Continuation: the request that continues a stream elsewhere, and the text after a migration being exactly the
text one undisturbed worker would have streamed (multi-byte characters and stop strings across the boundary)."""

import pytest

from pdserve.text.detokenizer import IncrementalDetokenizer
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.protocol import TokenEvent
from pdserve.wire.sampling import SamplingParams
from pdserve_router.migration import Continuation


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> PromptTokenizer:
    return PromptTokenizer(str(tiny_model_dir))


def worker_events(tokenizer, prompt, output, stop, finishes=True) -> list[TokenEvent]:
    """What one worker streams for `output`, one token per event, as the engine does (`finishes` False: it dies
    after the last one, before finishing)."""
    detokenizer = IncrementalDetokenizer(tokenizer.tokenizer, prompt, stop)
    events = []
    for i, token_id in enumerate(output):
        text, stopped = detokenizer.push([token_id])
        last = stopped or (finishes and i == len(output) - 1)
        if last and not stopped:
            text += detokenizer.flush()
        events.append(TokenEvent("r", [token_id], text, finish_reason=("stop" if stopped else "length") if last else None))
        if stopped:
            break
    return events


def migrated_stream(tokenizer, prompt, output, stop, cut_at) -> list[TokenEvent]:
    """The first worker streams `cut_at` tokens and dies; a second one, given prompt + those tokens, streams the rest
    (its detokenizer starts fresh, as a real worker's does)."""
    continuation = Continuation(prompt, SamplingParams(max_tokens=len(output), stop=stop), tokenizer.detokenizer)
    before = worker_events(tokenizer, prompt, output[:cut_at], stop, finishes=False)
    streamed = [continuation.absorb(event) for event in before]
    continuation.migrate()
    after = worker_events(tokenizer, continuation.next_prompt(), output[cut_at:], stop)
    return streamed + [continuation.absorb(event) for event in after]


def test_the_continued_request_carries_the_streamed_tokens_and_what_is_left_to_generate():
    continuation = Continuation([1, 2, 3], SamplingParams(max_tokens=10, min_tokens=4), lambda p, s: None)
    continuation.absorb(TokenEvent("r", [7, 8, 9]))
    assert continuation.next_prompt() == [1, 2, 3, 7, 8, 9]
    assert continuation.next_sampling().max_tokens == 7 and continuation.next_sampling().min_tokens == 1
    assert continuation.next_sampling().continued_tokens == 3  # penalties, a grammar and a seed go on after them
    continuation.absorb(TokenEvent("r", [10, 11]))
    assert continuation.next_sampling().min_tokens == 0 and continuation.next_sampling().continued_tokens == 5


@pytest.mark.parametrize("text", ["the quick brown fox jumps over the lazy dog", "héllo wörld ünïcode ✓ done"])
def test_text_after_a_migration_is_the_undisturbed_text_at_every_cut(tokenizer, text):
    prompt = tokenizer.encode("hello world")
    output = tokenizer.encode(text, add_special_tokens=False)
    undisturbed = "".join(e.text for e in worker_events(tokenizer, prompt, output, []))
    for cut_at in range(1, len(output)):
        events = migrated_stream(tokenizer, prompt, output, [], cut_at)
        assert "".join(e.text for e in events) == undisturbed, cut_at
        assert [t for e in events for t in e.token_ids] == output


def test_a_stop_string_across_the_migration_boundary_ends_the_stream(tokenizer):
    prompt = tokenizer.encode("hello world")
    output = tokenizer.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    undisturbed = worker_events(tokenizer, prompt, output, ["fox jumps"])
    expected_text = "".join(e.text for e in undisturbed)
    assert undisturbed[-1].finish_reason == "stop"
    for cut_at in range(1, len(undisturbed) - 1):
        events = migrated_stream(tokenizer, prompt, output, ["fox jumps"], cut_at)
        stopped_at = next(i for i, e in enumerate(events) if e.finish_reason is not None)
        assert events[stopped_at].finish_reason == "stop"
        assert "".join(e.text for e in events[: stopped_at + 1]) == expected_text
        assert [t for e in events[: stopped_at + 1] for t in e.token_ids] == [t for e in undisturbed for t in e.token_ids]
