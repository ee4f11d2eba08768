"""Response bodies validate as the OpenAI SDK's own types (what `openai` clients parse)."""

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve.text.reasoning import ReasoningFormat
from pdserve.text.tool_calls import V3_STYLE
from pdserve.wire.protocol import TokenEvent
from pdserve_router.responses import ChoiceOutput, ResponseBuilder, ResponseOptions, sse, usage


def builder(tokenizer, kind, logprobs=False, token_ids=False, **options) -> ResponseBuilder:
    return ResponseBuilder(kind, "id-1", 1700000000, "tiny", tokenizer,
                           ResponseOptions(logprobs=logprobs, return_token_ids=token_ids, **options))


def outputs() -> list[ChoiceOutput]:
    return [
        ChoiceOutput(0, [1, 2, 3], text="hello", token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length", cached_tokens=2),
        ChoiceOutput(1, [1, 2, 3], text="world", token_ids=[7], logprobs=[-0.3], finish_reason="stop", cached_tokens=2),
    ]


def test_usage_counts_a_shared_prompt_once_and_reports_cached_tokens():
    assert usage(outputs(), prompt_counted_once_per=2) == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_whole_completion_parses_as_sdk_completion_with_token_ids(tiny_model_dir):
    from pdserve.text.tokenizer import PromptTokenizer

    body = builder(PromptTokenizer(str(tiny_model_dir)), "completion", logprobs=True, token_ids=True).whole(outputs(), usage(outputs(), 2))
    parsed = Completion.model_validate(body)
    assert [c.text for c in parsed.choices] == ["hello", "world"]
    assert parsed.choices[0].logprobs.token_logprobs == [-0.1, -0.2]
    assert body["choices"][0]["token_ids"] == [5, 6] and body["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_whole_chat_and_chunks_parse_as_sdk_types(tiny_model_dir):
    from pdserve.text.tokenizer import PromptTokenizer

    chat = builder(PromptTokenizer(str(tiny_model_dir)), "chat", logprobs=True)
    parsed = ChatCompletion.model_validate(chat.whole(outputs(), usage(outputs(), 2)))
    assert parsed.choices[1].message.content == "world" and parsed.choices[0].finish_reason == "length"
    assert [t.logprob for t in parsed.choices[0].logprobs.content] == [-0.1, -0.2]
    chunk = chat.chunk(outputs()[0], TokenEvent("r", [5], "he", [-0.1]), first=True, text_offset=0)
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    parsed_chunk = ChatCompletionChunk.model_validate(json.loads(chunk[6:]))
    assert parsed_chunk.choices[0].delta.role == "assistant" and parsed_chunk.choices[0].delta.content == "he"
    usage_chunk = ChatCompletionChunk.model_validate(json.loads(chat.usage_chunk(usage(outputs(), 2))[6:]))
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == 6


def test_top_logprobs_in_chat_and_completion_bodies(tiny_model_dir):
    from pdserve.text.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(str(tiny_model_dir))
    choice = ChoiceOutput(0, [1], text="ab", token_ids=[5, 6], logprobs=[-0.1, -0.2],
                          top_token_ids=[[5, 9], [6, 8]], top_logprobs=[[-0.1, -2.5], [-0.2, -3.0]], finish_reason="stop")
    chat = ChatCompletion.model_validate(builder(tokenizer, "chat", True, top_logprobs=2).whole([choice], usage([choice], 1)))
    alternatives = chat.choices[0].logprobs.content[1].top_logprobs
    assert [a.logprob for a in alternatives] == [-0.2, -3.0]
    assert alternatives[1].token == tokenizer.decode([8])
    completion = Completion.model_validate(builder(tokenizer, "completion", True, top_logprobs=2).whole([choice], usage([choice], 1)))
    assert completion.choices[0].logprobs.top_logprobs[0] == {tokenizer.decode([5]): -0.1, tokenizer.decode([9]): -2.5}


CALL_TEXT = ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
             '{"city":"Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}'
             '\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def test_tool_calls_are_parsed_out_of_a_whole_chat_response(tiny_model_dir):
    from pdserve.text.tokenizer import PromptTokenizer

    choice = ChoiceOutput(0, [1], text=CALL_TEXT, token_ids=[5], finish_reason="stop")
    chat = builder(PromptTokenizer(str(tiny_model_dir)), "chat", tool_style=V3_STYLE)
    parsed = ChatCompletion.model_validate(chat.whole([choice], usage([choice], 1)))
    message = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert len({c.id for c in message.tool_calls}) == 2
    one = builder(PromptTokenizer(str(tiny_model_dir)), "chat", tool_style=V3_STYLE, max_tool_calls=1)
    assert len(ChatCompletion.model_validate(one.whole([choice], usage([choice], 1))).choices[0].message.tool_calls) == 1


def test_streamed_tool_call_deltas_add_up_to_the_whole_calls(tiny_model_dir):
    from pdserve.text.tokenizer import PromptTokenizer

    chat = builder(PromptTokenizer(str(tiny_model_dir)), "chat", tool_style=V3_STYLE)
    choice = ChoiceOutput(0, [1])
    content, calls, finish = "", {}, None
    pieces = [CALL_TEXT[i:i + 5] for i in range(0, len(CALL_TEXT), 5)]
    for position, piece in enumerate(pieces):
        last = position == len(pieces) - 1
        chunk = chat.chunk(choice, TokenEvent("r", [5], piece, finish_reason="stop" if last else None), position == 0, 0)
        if chunk is None:
            continue
        delta = ChatCompletionChunk.model_validate(json.loads(chunk[6:])).choices[0]
        content += delta.delta.content or ""
        finish = delta.finish_reason or finish
        for call in delta.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
    assert content == "Sure." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert all(c["id"] for c in calls.values())


def test_an_sse_event_is_one_line_whatever_its_text_holds():
    """U+0085, U+2028 and U+2029 end a line for str.splitlines and httpx's aiter_lines: escaped, the event stays one
    line and decodes to the same text."""
    text = "a\u2028b\u2029c\x85d\ne"
    event = sse({"choices": [{"text": text}]})
    lines = event.decode().splitlines()
    assert lines == [lines[0], ""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text


def responses_builder(tokenizer, **options):
    from pdserve_router.responses_api_output import ResponsesBuilder
    from pdserve_router.responses_api_request import ResponsesRequest

    return ResponsesBuilder("resp_1", 1700000000, "tiny", tokenizer, ResponseOptions(**options),
                            ResponsesRequest(model="tiny", input="hi", max_output_tokens=7))


def stream_events(chunks: bytes) -> list:
    """Each `event:` / `data:` pair of a Responses stream, validated as the SDK's event union (the names agree)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter, events = TypeAdapter(ResponseStreamEvent), []
    for block in chunks.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    return events


def test_responses_api_stream_of_text_and_calls_validates_and_ends_as_the_whole_response(tiny_model_dir):
    from openai.types.responses import Response

    from pdserve.text.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(str(tiny_model_dir))
    streaming, choice = responses_builder(tokenizer, tool_style=V3_STYLE), ChoiceOutput(0, [1, 2])
    chunks = streaming.head()
    pieces = [CALL_TEXT[i:i + 5] for i in range(0, len(CALL_TEXT), 5)]
    for position, piece in enumerate(pieces):
        event = TokenEvent("r", [5], piece, finish_reason="stop" if position == len(pieces) - 1 else None)
        choice.text += piece
        choice.token_ids.append(5)
        choice.finish_reason = event.finish_reason
        chunks += streaming.chunk(choice, event, position == 0, 0) or b""
    chunks += streaming.tail([choice], usage([choice], 1))
    events = stream_events(chunks)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert added == done == [(0, "message"), (1, "function_call"), (2, "function_call")]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure."
    arguments = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            arguments[e.output_index] = arguments.get(e.output_index, "") + e.delta
    assert arguments == {1: '{"city":"Paris"}', 2: "{}"}
    streamed = events[-1].response
    whole_body = responses_builder(tokenizer, tool_style=V3_STYLE).whole([choice], usage([choice], 1))
    whole = Response.model_validate(whole_body)
    assert streamed.output_text == whole.output_text == "Sure."
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in streamed.output] == [
        (i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole.output]
    assert whole.usage.input_tokens == 2 and whole.usage.output_tokens == len(pieces) and whole.max_output_tokens == 7


def test_responses_api_stream_ends_failed_or_incomplete(tiny_model_dir):
    from pdserve.text.tokenizer import PromptTokenizer
    from pdserve_router.errors import APIError

    tokenizer = PromptTokenizer(str(tiny_model_dir))
    choice = ChoiceOutput(0, [1], text="ab", token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length")
    cut = responses_builder(tokenizer, logprobs=True)
    events = stream_events(cut.head() + cut.chunk(choice, TokenEvent("r", [5, 6], "ab", [-0.1, -0.2]), True, 0)
                           + cut.tail([choice], usage([choice], 1)))
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [p.logprob for p in events[-1].response.output[0].content[0].logprobs] == [-0.1, -0.2]
    failing = responses_builder(tokenizer)
    chunks = failing.head() + failing.failed(APIError(502, "the worker failed", type="server_error"))
    events = stream_events(chunks + failing.tail([choice], usage([choice], 1)))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.error.message == "the worker failed" and events[-1].response.status == "failed"


TAGS = ReasoningFormat(start_id=3, end_id=4)  # the tiny tokenizer has no thinking tags: ids for the usage count
THINKING = "<think>Is it 2? Yes.</think>\n\nIt is 2.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"


def test_reasoning_comes_apart_from_content_and_calls_whole_and_streamed(tiny_model_dir):
    from pdserve.text.tokenizer import PromptTokenizer

    chat = builder(PromptTokenizer(str(tiny_model_dir)), "chat", tool_style=V3_STYLE, reasoning=TAGS)
    choice = ChoiceOutput(0, [1], text=THINKING, token_ids=[5], finish_reason="stop")
    message = chat.whole([choice], usage([choice], 1))["choices"][0]["message"]
    assert message["reasoning_content"] == "Is it 2? Yes." and message["content"] == "\n\nIt is 2."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    streamed, reasoning, content, names = ChoiceOutput(0, [1]), "", "", []
    pieces = [THINKING[i:i + 3] for i in range(0, len(THINKING), 3)]
    for position, piece in enumerate(pieces):
        event = TokenEvent("r", [5], piece, finish_reason="stop" if position == len(pieces) - 1 else None)
        chunk = chat.chunk(streamed, event, position == 0, 0)
        if chunk is not None:
            delta = json.loads(chunk[6:])["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            names += [c["function"]["name"] for c in delta.get("tool_calls", []) if "name" in c["function"]]
    assert (reasoning, content, names) == ("Is it 2? Yes.", "\n\nIt is 2.", ["f"])
    plain = builder(PromptTokenizer(str(tiny_model_dir)), "chat")  # a model that does not think: text untouched
    assert "reasoning_content" not in plain.whole([choice], usage([choice], 1))["choices"][0]["message"]


def test_responses_api_reasoning_item_comes_first_whole_and_streamed(tiny_model_dir):
    from openai.types.responses import Response

    from pdserve.text.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(str(tiny_model_dir))
    text = "Is it 2? Yes.</think>It is 2."
    choice = ChoiceOutput(0, [1], text=text, token_ids=[5, 6], finish_reason="stop")
    whole = Response.model_validate(responses_builder(tokenizer, reasoning=TAGS, reasoning_opened=True).whole([choice], usage([choice], 1)))
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Is it 2? Yes." and whole.output_text == "It is 2."
    streaming = responses_builder(tokenizer, reasoning=TAGS, reasoning_opened=True)
    chunks = streaming.head()
    for position in range(0, len(text), 4):
        last = position + 4 >= len(text)
        chunks += streaming.chunk(choice, TokenEvent("r", [5], text[position:position + 4],
                                                     finish_reason="stop" if last else None), False, 0) or b""
    events = stream_events(chunks + streaming.tail([choice], usage([choice], 1)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Is it 2? Yes."
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == ["Is it 2? Yes."]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "It is 2."


def test_usage_counts_the_reasoning_tokens_tags_included(tiny_model_dir):
    from openai.types.responses import Response

    from pdserve.text.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(str(tiny_model_dir))
    thought = ChoiceOutput(0, [1], text="t", token_ids=[3, 7, 8, 4, 9], finish_reason="stop")  # <think> 7 8 </think> 9
    chat = builder(tokenizer, "chat", reasoning=TAGS)
    assert chat.usage([thought])["completion_tokens_details"] == {"reasoning_tokens": 4}
    opened = builder(tokenizer, "chat", reasoning=TAGS, reasoning_opened=True)
    cut = ChoiceOutput(0, [1], text="t", token_ids=[7, 8, 9], finish_reason="length")  # never closed: all reasoning
    assert opened.usage([cut, thought])["completion_tokens_details"] == {"reasoning_tokens": 3 + 4}
    assert "completion_tokens_details" not in builder(tokenizer, "chat").usage([thought])
    responses = responses_builder(tokenizer, reasoning=TAGS)
    whole = Response.model_validate(responses.whole([thought], responses.usage([thought])))
    assert whole.usage.output_tokens_details.reasoning_tokens == 4 and whole.usage.output_tokens == 5
