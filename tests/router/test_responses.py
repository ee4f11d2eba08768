"""Response bodies validate as the OpenAI SDK's own types (what `openai` clients parse)."""

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve_router.responses import ChoiceOutput, ResponseBuilder, usage


def builder(tokenizer, kind, logprobs=False, token_ids=False) -> ResponseBuilder:
    return ResponseBuilder(kind, "id-1", 1700000000, "tiny", tokenizer, logprobs, token_ids)


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
    chunk = chat.chunk(outputs()[0], "he", [5], [-0.1], None, first=True, text_offset=0)
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    parsed_chunk = ChatCompletionChunk.model_validate(json.loads(chunk[6:]))
    assert parsed_chunk.choices[0].delta.role == "assistant" and parsed_chunk.choices[0].delta.content == "he"
    usage_chunk = ChatCompletionChunk.model_validate(json.loads(chat.usage_chunk(usage(outputs(), 2))[6:]))
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == 6
