"""Grammar-constrained decoding in the engine, on a tiny V3 model with DeepSeek's real tokenizer: greedy and sampled
outputs follow the schema every time, and a tool-call grammar yields a parseable call. (The prefill/decode hand-off
of a constrained request is tested on a cluster: tests/router/test_openai_clients.py.)"""

import concurrent.futures
import json
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import grammar as grammar_module
from pdserve.engine.grammar import apply_token_masks
from pdserve.text.grammars import json_schema_source
from pdserve.text.tool_calls import V3_1_STYLE, V3_STYLE, DeepSeekToolCalls, ToolCallParser, ToolSpec
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.sampling import Grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
        "sky": {"enum": ["sunny", "cloudy", "rain"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["city", "temperature_c", "sky", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["What is the weather in Paris?", "Describe the sky.", "0 1 2 3", "Answer in JSON:", "Tell me about trains."]


@pytest.fixture(scope="module")
def llm(tiny_v3_deepseek):
    return LLM(tiny_v3_deepseek, progress=False)


def test_masks_set_exactly_the_disallowed_tokens_to_minus_infinity():
    rng = np.random.default_rng(0)
    vocab_size = 70
    masks = [rng.integers(-2**31, 2**31, size=3, dtype=np.int64).astype(np.int32) for _ in range(2)]
    logits = torch.randn(3, vocab_size)
    masked = logits.clone()
    apply_token_masks(masked, [0, 2], masks)
    for row, mask in zip([0, 2], masks):
        for token in range(vocab_size):
            allowed = (int(mask[token // 32]) >> (token % 32)) & 1
            assert (masked[row, token].item() == float("-inf")) != bool(allowed)
    assert torch.equal(masked[1], logits[1])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_are_valid_json_for_the_schema_every_time(llm, temperature):
    grammar = Grammar("json_schema", json_schema_source(SCHEMA))
    sampling = [SamplingParams(max_tokens=120, temperature=temperature, seed=seed, grammar=grammar)
                for seed in range(4) for _ in PROMPTS]
    results = llm.generate(PROMPTS * 4, sampling)
    for result in results:
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), SCHEMA)


@pytest.mark.parametrize(("style", "parallel"), [(V3_STYLE, False), (V3_1_STYLE, False), (V3_1_STYLE, True)])
def test_required_tool_call_grammar_gives_parseable_calls_in_the_models_style(llm, tiny_v3_deepseek, style, parallel):
    tokenizer = PromptTokenizer(tiny_v3_deepseek)
    tools = [ToolSpec("get_weather", {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                      "required": ["city"], "additionalProperties": False}),
             ToolSpec("get_time", {"type": "object", "properties": {}, "additionalProperties": False})]
    grammar = Grammar("lark", DeepSeekToolCalls.for_tokenizer(tokenizer.tokenizer, style).grammar(tools, parallel))
    sampling = [SamplingParams(max_tokens=80, temperature=1.0, seed=seed, grammar=grammar)
                for seed in range(len(PROMPTS))]
    for result in llm.generate(PROMPTS, sampling):
        parser = ToolCallParser(style)
        content, deltas = parser.feed(result.text)
        more_content, more = parser.finish()
        assert result.finish_reason == "stop" and content + more_content == ""
        assert parser.calls >= 1 and (parallel or parser.calls == 1)
        for index in range(parser.calls):
            mine = [d for d in deltas + more if d.index == index]
            assert mine[0].name in ("get_weather", "get_time")
            json.loads("".join(d.arguments for d in mine))


def test_a_migrated_stream_continues_the_grammar_after_its_streamed_tokens(llm):
    """A stream moved to another worker arrives as prompt + streamed tokens; its matcher starts after them, so the
    continuation completes the same JSON as an undisturbed run."""
    grammar = Grammar("json_schema", json_schema_source(SCHEMA))
    prompt = llm.engine.tokenizer.encode(PROMPTS[1])
    whole = llm.generate(prompt_token_ids=[prompt], sampling=SamplingParams(max_tokens=120, temperature=0.0, grammar=grammar))[0]
    streamed = whole.token_ids[:5]
    rest = llm.generate(prompt_token_ids=[prompt + streamed], sampling=SamplingParams(
        max_tokens=115, temperature=0.0, grammar=grammar, continued_tokens=len(streamed)))[0]
    assert streamed + rest.token_ids == whole.token_ids
    jsonschema.validate(json.loads(whole.text), SCHEMA)


class BorrowCheckedMatcher:
    """Stands in for llguidance's matcher where it matters here: like the Rust object, it refuses a call while the
    mask thread holds it. Complete after three tokens."""

    def __init__(self) -> None:
        self.held, self.consumed = threading.Event(), 0

    def _check(self) -> None:
        if self.held.is_set():
            raise RuntimeError("Already mutably borrowed")

    def is_stopped(self) -> bool:
        self._check()
        return self.consumed >= 3

    def consume_token(self, token_id: int) -> bool:
        self._check()
        self.consumed += 1
        return True


def slow_fill(matcher: BorrowCheckedMatcher, mask: np.ndarray) -> None:
    matcher.held.set()
    time.sleep(0.05)
    matcher.held.clear()


def test_the_step_thread_never_touches_a_matcher_the_mask_thread_holds(monkeypatch):
    monkeypatch.setattr(grammar_module, "fill_next_token_bitmask", slow_fill)
    mask_thread = concurrent.futures.ThreadPoolExecutor(1)
    request_grammar = grammar_module.RequestGrammar(BorrowCheckedMatcher(), 64, mask_thread)
    assert not request_grammar.finished  # while the first mask is computed
    for token_id in (5, 6):
        request_grammar.accept(token_id)
        assert not request_grammar.finished  # while the next mask is computed
    request_grammar.accept(7)
    assert request_grammar.finished
    mask_thread.shutdown()
