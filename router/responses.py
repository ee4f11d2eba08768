"""OpenAI response shapes (completions and chat, whole and streamed as SSE chunks), built from finished choices."""

from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.text.tokenizer import PromptTokenizer


@dataclass
class ChoiceOutput:
    """What has come back so far for one choice."""

    index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None


def usage(choices: list[ChoiceOutput], prompt_counted_once_per: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (n choices of one prompt share it), as OpenAI reports them."""
    prompts = choices[::prompt_counted_once_per]
    prompt_tokens = sum(len(c.prompt_token_ids) for c in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in prompts)},
    }


def completion_logprobs(tokenizer: PromptTokenizer, token_ids: list[int], logprobs: list[float], offset: int) -> dict[str, Any]:
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokenizer: PromptTokenizer, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(token_ids, logprobs):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


class ResponseBuilder:
    """Builds the JSON bodies of one request (`kind` completion or chat)."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, tokenizer: PromptTokenizer,
                 wants_logprobs: bool, return_token_ids: bool) -> None:
        self.kind = kind
        self.request_id = request_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.wants_logprobs = wants_logprobs
        self.return_token_ids = return_token_ids

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, choices: list[ChoiceOutput], usage_body: dict[str, Any]) -> dict[str, Any]:
        rendered = []
        for choice in choices:
            if self.kind == "chat":
                item: dict[str, Any] = {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": choice.text},
                    "logprobs": chat_logprobs(self.tokenizer, choice.token_ids, choice.logprobs) if self.wants_logprobs else None,
                    "finish_reason": choice.finish_reason,
                }
            else:
                item = {
                    "index": choice.index,
                    "text": choice.text,
                    "logprobs": completion_logprobs(self.tokenizer, choice.token_ids, choice.logprobs, 0) if self.wants_logprobs else None,
                    "finish_reason": choice.finish_reason,
                }
            if self.return_token_ids:
                item["prompt_token_ids"] = choice.prompt_token_ids
                item["token_ids"] = choice.token_ids
            rendered.append(item)
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion", rendered)
        body["usage"] = usage_body
        return body

    def chunk(self, choice: ChoiceOutput, text: str, token_ids: list[int], logprobs: list[float] | None,
              finish_reason: str | None, first: bool, text_offset: int) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            item: dict[str, Any] = {
                "index": choice.index, "delta": delta,
                "logprobs": chat_logprobs(self.tokenizer, token_ids, logprobs or []) if self.wants_logprobs else None,
                "finish_reason": finish_reason,
            }
        else:
            item = {
                "index": choice.index, "text": text,
                "logprobs": completion_logprobs(self.tokenizer, token_ids, logprobs or [], text_offset) if self.wants_logprobs else None,
                "finish_reason": finish_reason,
            }
        if self.return_token_ids:
            item["token_ids"] = token_ids
            if first:
                item["prompt_token_ids"] = choice.prompt_token_ids
        return sse(self._envelope(self._chunk_object(), [item]))

    def usage_chunk(self, usage_body: dict[str, Any]) -> bytes:
        body = self._envelope(self._chunk_object(), [])
        body["usage"] = usage_body
        return sse(body)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
