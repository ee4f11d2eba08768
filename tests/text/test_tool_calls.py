"""DeepSeek's two tool-call styles: read from the chat template, parsed whole and in any pieces, and made by the
grammar that `tool_choice` required uses."""

import pytest
from grammar_matching import grammar_takes
from v3_1_template import V3_1_TEMPLATE, with_v3_1_template

from pdserve.text.tokenizer import PromptTokenizer
from pdserve.text.tool_calls import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEPARATOR, V3_1_STYLE, V3_STYLE,
                                     CallStyle, DeepSeekToolCalls, ToolCallParser, ToolSpec)
from pdserve.wire.sampling import Grammar

V3_1_CALLS = (f'Checking.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEPARATOR}{{"city":"Paris"}}{CALL_END}'
              f"{CALL_BEGIN}get_time{SEPARATOR}{{}}{CALL_END}{CALLS_END}")


@pytest.fixture(scope="module")
def v3_1_model(tiny_v3_deepseek, tmp_path_factory) -> str:
    return with_v3_1_template(tiny_v3_deepseek, tmp_path_factory.mktemp("v3_1"))


def style_of(model_dir: str) -> CallStyle:
    tokenizer = PromptTokenizer(model_dir)
    return CallStyle.of_template(lambda messages: tokenizer.render_chat(messages, False))


def test_the_style_is_read_from_the_chat_template(tiny_v3_deepseek, v3_1_model, tiny_model_dir):
    assert style_of(tiny_v3_deepseek) == V3_STYLE
    assert style_of(v3_1_model) == V3_1_STYLE
    assert style_of(tiny_model_dir) == V3_STYLE  # a template that renders no calls (it refuses them): V3's


@pytest.mark.parametrize("size", [1, 2, 5, 11, len(V3_1_CALLS)])
def test_v3_1_calls_parse_the_same_in_pieces_of_any_size(size):
    parser, content, deltas = ToolCallParser(V3_1_STYLE), "", []
    for start in range(0, len(V3_1_CALLS), size):
        more_content, more = parser.feed(V3_1_CALLS[start:start + size])
        content, deltas = content + more_content, deltas + more
    tail, more = parser.finish()
    calls: dict[int, list[str]] = {}
    for delta in deltas + more:
        entry = calls.setdefault(delta.index, [delta.name or "", ""])
        entry[1] += delta.arguments
    assert content + tail == "Checking." and calls == {0: ["get_weather", '{"city":"Paris"}'], 1: ["get_time", "{}"]}


def test_the_v3_1_grammar_takes_back_to_back_calls_and_not_v3s(v3_1_model):
    tokenizer = PromptTokenizer(v3_1_model)
    ids = {marker: tokenizer.tokenizer.token_to_id(marker) for marker in (CALLS_BEGIN, CALL_BEGIN, SEPARATOR, CALL_END,
                                                                          CALLS_END)}
    tools = [ToolSpec("get_time", {"type": "object", "properties": {}, "additionalProperties": False})]
    call = [ids[CALL_BEGIN], "get_time", ids[SEPARATOR], "{}", ids[CALL_END]]
    v3_call = [ids[CALL_BEGIN], "function", ids[SEPARATOR], "get_time\n```json\n{}\n```", ids[CALL_END]]
    parallel = Grammar("lark", DeepSeekToolCalls.for_tokenizer(tokenizer.tokenizer, V3_1_STYLE).grammar(tools, True))
    assert grammar_takes(v3_1_model, tokenizer, parallel, [ids[CALLS_BEGIN], *call, *call, ids[CALLS_END]])
    assert not grammar_takes(v3_1_model, tokenizer, parallel, [ids[CALLS_BEGIN], *v3_call])
    v3 = Grammar("lark", DeepSeekToolCalls.for_tokenizer(tokenizer.tokenizer, V3_STYLE).grammar(tools, True))
    assert grammar_takes(v3_1_model, tokenizer, v3, [ids[CALLS_BEGIN], *v3_call, "\n", *v3_call, ids[CALLS_END]])


def test_a_template_that_writes_calls_only_for_null_content_is_read_and_gets_them(tiny_v3_deepseek, tmp_path):
    """As DeepSeek-V3's and R1's templates do: an assistant turn's calls are written only when its content is none,
    so the router keeps a tool-call turn's null content (an empty string would drop the calls from the prompt)."""
    from pdserve_router.openai_schema import ChatMessage, FunctionCall, ToolCall, chat_messages_of

    template = V3_1_TEMPLATE.replace("{%- if message['tool_calls'] -%}",
                                     "{%- if message['tool_calls'] and message['content'] is none -%}")
    model_dir = with_v3_1_template(tiny_v3_deepseek, tmp_path, template)
    assert style_of(model_dir) == V3_1_STYLE
    for content in (None, ""):  # the SDK sends null; some clients send ""
        turn = ChatMessage(role="assistant", content=content,
                           tool_calls=[ToolCall("call_1", FunctionCall("get_time", "{}"))])
        rendered = PromptTokenizer(model_dir).render_chat(
            chat_messages_of([ChatMessage(role="user", content="?"), turn]), False)
        assert f"{CALL_BEGIN}get_time{SEPARATOR}{{}}{CALL_END}" in rendered
