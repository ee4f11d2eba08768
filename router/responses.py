"""OpenAI response shapes (completions and chat, whole and streamed as SSE chunks), built from what the workers
streamed: text, token ids, log-probabilities, and for chat requests with tools the tool calls parsed out of the text."""

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.text.reasoning import ReasoningFormat, ReasoningParser, split_reasoning
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.text.tool_calls import CallStyle, ToolCallDelta, ToolCallParser
from pdserve.wire.protocol import TokenEvent
from pdserve_router.errors import APIError


@dataclass(frozen=True)
class ResponseOptions:
    """What the request asked the response to contain."""

    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    tool_style: CallStyle | None = None  # the request offered tools: how the model writes the calls to parse
    max_tool_calls: int | None = None  # parallel_tool_calls: false -> 1
    echo_texts: list[str] | None = None  # completions with echo: per prompt, the text put before the output
    n: int = 1  # choices per prompt
    include_usage: bool = False  # streams: a last chunk with the usage (stream_options.include_usage)
    reasoning: ReasoningFormat | None = None  # the model's thinking tags, when its reasoning is returned apart
    reasoning_opened: bool = False  # ...and whether the prompt opened the reasoning
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs`: its field, with this many alternatives


@dataclass
class ChoiceOutput:
    """What has come back so far for one choice."""

    index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # echo with logprobs: the prompt's, as the first event brought them (the first token's None)
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top_token_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    tool_parser: ToolCallParser | None = None  # streaming: the parser this choice's chunks go through
    reasoning_parser: ReasoningParser | None = None  # streaming: the same, for the reasoning
    tool_call_ids: list[str] = field(default_factory=list)


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


def completion_logprobs(tokenizer: PromptTokenizer, token_ids: list[int], logprobs: list[float | None], offset: int,
                        top_ids: list[list[int]] | None = None, top_values: list[list[float]] | None = None) -> dict[str, Any]:
    """OpenAI's completions logprobs; a position with no log-probability (an echoed prompt's first token) has null
    in `token_logprobs` and `top_logprobs`."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    top = None
    if top_ids:
        top = [None if logprob is None else {tokenizer.decode([t]): v for t, v in zip(ids, values)}
               for ids, values, logprob in zip(top_ids, top_values or [], logprobs)]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: PromptTokenizer, choice: ChoiceOutput, alternatives: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first null), its id and up to `alternatives` more, each
    mapped to its log-probability, rank and text."""
    if choice.prompt_logprobs is None:
        return None
    positions: list = [None]
    for position in range(1, len(choice.prompt_token_ids)):
        token_id, logprob = choice.prompt_token_ids[position], choice.prompt_logprobs[position]
        entries = {str(token_id): {"logprob": logprob, "rank": choice.prompt_ranks[position],
                                   "decoded_token": tokenizer.decode([token_id])}}
        top = zip(choice.prompt_top_token_ids[position][:alternatives], choice.prompt_top_logprobs[position])
        for rank, (top_id, top_logprob) in enumerate(top, start=1):
            entries.setdefault(str(top_id), {"logprob": top_logprob, "rank": rank,
                                             "decoded_token": tokenizer.decode([top_id])})
        positions.append(entries)
    return positions


def chat_logprobs(tokenizer: PromptTokenizer, token_ids: list[int], logprobs: list[float],
                  top_ids: list[list[int]] | None = None, top_values: list[list[float]] | None = None) -> dict[str, Any]:
    content = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        alternatives = []
        if top_ids and position < len(top_ids):
            alternatives = [_token_logprob(tokenizer, t, v) for t, v in zip(top_ids[position], (top_values or [])[position])]
        content.append({**_token_logprob(tokenizer, token_id, logprob), "top_logprobs": alternatives})
    return {"content": content}


def _token_logprob(tokenizer: PromptTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    token = tokenizer.decode([token_id])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


class ResponseBuilder:
    """Builds the JSON bodies of one request (`kind` completion or chat)."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, tokenizer: PromptTokenizer,
                 options: ResponseOptions) -> None:
        self.kind = kind
        self.request_id = request_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.options = options

    def usage(self, choices: list[ChoiceOutput]) -> dict[str, Any]:
        """The request's usage; with the reasoning returned apart, also how many output tokens were reasoning."""
        body = usage(choices, self.options.n)
        reasoning = self.reasoning_tokens(choices)
        if reasoning is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return body

    def reasoning_tokens(self, choices: list[ChoiceOutput]) -> int | None:
        """Output tokens spent reasoning, tags included; None unless the reasoning is returned apart."""
        reasoning = self.options.reasoning
        if reasoning is None or self.kind != "chat":
            return None
        return sum(reasoning.reasoning_tokens(c.token_ids, self.options.reasoning_opened) for c in choices)

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, token_ids, logprobs, top_ids, top_values, text_offset: int = 0) -> dict[str, Any] | None:
        if not self.options.logprobs:
            return None
        top_ids, top_values = (top_ids, top_values) if self.options.top_logprobs else (None, None)
        if self.kind == "chat":
            return chat_logprobs(self.tokenizer, token_ids, logprobs, top_ids, top_values)
        return completion_logprobs(self.tokenizer, token_ids, logprobs, text_offset, top_ids, top_values)

    def _echo(self, choice: ChoiceOutput) -> str:
        echo = self.options.echo_texts
        return echo[choice.index // self.options.n] if echo else ""

    def _with_prompt_logprobs(self, choice: ChoiceOutput, token_ids: list[int], logprobs: list[float],
                              top_ids: list[list[int]] | None, top_values: list[list[float]] | None) -> tuple[
            list[int], list[float | None], list[list[int]] | None, list[list[float]] | None]:
        """An echoed completion's log-probabilities: the prompt's tokens before the output's (once, in the whole
        response or the first chunk)."""
        if choice.prompt_logprobs is None or not self.options.echo_texts:
            return token_ids, logprobs, top_ids, top_values
        n = self.options.top_logprobs  # the workers computed as many as vLLM's prompt_logprobs asked, if more
        return (choice.prompt_token_ids + token_ids, choice.prompt_logprobs + logprobs,
                [ids[:n] for ids in choice.prompt_top_token_ids] + (top_ids or []),
                [values[:n] for values in choice.prompt_top_logprobs] + (top_values or []))

    def whole(self, choices: list[ChoiceOutput], usage_body: dict[str, Any]) -> dict[str, Any]:
        rendered = []
        for choice in choices:
            logprobs = self._logprobs(*self._with_prompt_logprobs(
                choice, choice.token_ids, choice.logprobs, choice.top_token_ids, choice.top_logprobs))
            if self.kind == "chat":
                text, reasoning = choice.text, None
                if self.options.reasoning is not None:
                    reasoning, text = split_reasoning(text, self.options.reasoning_opened)
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning is not None:
                    message["reasoning_content"] = reasoning or None
                finish_reason = choice.finish_reason
                if self.options.tool_style is not None:
                    parser = ToolCallParser(self.options.tool_style)
                    content, deltas = parser.feed(text)
                    tail, more = parser.finish()
                    calls = self._calls(choice, deltas + more)
                    message["content"] = (content + tail) or (None if calls else "")
                    if calls:
                        message["tool_calls"] = calls
                        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                item: dict[str, Any] = {"index": choice.index, "message": message, "logprobs": logprobs,
                                        "finish_reason": finish_reason}
            else:
                item = {"index": choice.index, "text": self._echo(choice) + choice.text, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason}
            if self.options.return_token_ids:
                item["prompt_token_ids"] = choice.prompt_token_ids
                item["token_ids"] = choice.token_ids
            if self.options.prompt_logprobs is not None and self.kind != "chat":
                item["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, choice, self.options.prompt_logprobs)
            rendered.append(item)
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion", rendered)
        if self.options.prompt_logprobs is not None and self.kind == "chat" and choices:  # vLLM: once, the prompt's
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, choices[0], self.options.prompt_logprobs)
        body["usage"] = usage_body
        return body

    def _calls(self, choice: ChoiceOutput, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        """Whole tool calls from a parse of the whole text (at most max_tool_calls)."""
        calls: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.name is not None:
                calls.append({"id": self._call_id(choice, delta.index), "type": "function",
                              "function": {"name": delta.name, "arguments": ""}})
            if calls and delta.index == len(calls) - 1:
                calls[-1]["function"]["arguments"] += delta.arguments
        return calls[: self.options.max_tool_calls]

    @staticmethod
    def _call_id(choice: ChoiceOutput, index: int) -> str:
        while len(choice.tool_call_ids) <= index:
            choice.tool_call_ids.append("call_" + uuid.uuid4().hex[:24])
        return choice.tool_call_ids[index]

    def chunk(self, choice: ChoiceOutput, event: TokenEvent, first: bool, text_offset: int) -> bytes | None:
        """The SSE chunk for one worker event of `choice` (None when it holds nothing to send yet)."""
        parts = (event.token_ids, event.logprobs or [], event.top_token_ids, event.top_logprobs)
        if first and choice.prompt_logprobs is not None:  # offsets from the echoed prompt's start
            parts = self._with_prompt_logprobs(choice, *parts)
        elif self.kind == "completion":
            text_offset += len(self._echo(choice))  # past the echoed prompt
        logprobs = self._logprobs(*parts, text_offset)
        finish_reason = event.finish_reason
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            reasoning, content, calls = self.stream_parts(choice, event)
            if choice.tool_parser is not None and choice.tool_parser.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not (calls or reasoning):
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            if not (first or reasoning or content or calls or finish_reason or event.token_ids):
                return None
            item: dict[str, Any] = {"index": choice.index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": finish_reason}
        else:
            text = (self._echo(choice) if first else "") + event.text
            item = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.options.return_token_ids:
            item["token_ids"] = event.token_ids
            if first:
                item["prompt_token_ids"] = choice.prompt_token_ids
        return sse(self._envelope(self._chunk_object(), [item]))

    def stream_parts(self, choice: ChoiceOutput, event: TokenEvent) -> tuple[str, str, list[dict[str, Any]]]:
        """An event's text split into reasoning, content and chat tool-call deltas (each with its call's index; id,
        type and name with its first delta), as far as the choice's parsers have seen."""
        reasoning, content = "", event.text
        finished = event.finish_reason is not None
        if self.options.reasoning is not None:
            if choice.reasoning_parser is None:
                choice.reasoning_parser = ReasoningParser(self.options.reasoning_opened)
            reasoning, content = choice.reasoning_parser.feed(event.text)
            if finished:
                more_reasoning, more_content = choice.reasoning_parser.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.options.tool_style is None:
            return reasoning, content, []
        content, calls = self._stream_tool_calls(choice, content, finished)
        return reasoning, content, calls

    def _stream_tool_calls(self, choice: ChoiceOutput, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if choice.tool_parser is None:
            choice.tool_parser = ToolCallParser(self.options.tool_style)
        content, deltas = choice.tool_parser.feed(text)
        if finished:
            tail, more = choice.tool_parser.finish()
            content, deltas = content + tail, deltas + more
        limit = self.options.max_tool_calls
        calls = []
        for delta in deltas:
            if limit is not None and delta.index >= limit:
                continue
            call: dict[str, Any] = {"index": delta.index, "function": {"arguments": delta.arguments}}
            if delta.name is not None:
                call.update(id=self._call_id(choice, delta.index), type="function")
                call["function"]["name"] = delta.name
            calls.append(call)
        return content, calls

    def head(self) -> bytes:
        """What a stream sends before its first chunk: nothing, for completions and chat."""
        return b""

    def failed(self, error: APIError) -> bytes:
        return sse(error.body())

    def tail(self, choices: list[ChoiceOutput], usage_body: dict[str, Any]) -> bytes:
        """What ends a stream: the usage chunk if asked for, then [DONE]."""
        return (self.usage_chunk(usage_body) if self.options.include_usage else b"") + SSE_DONE

    def usage_chunk(self, usage_body: dict[str, Any]) -> bytes:
        body = self._envelope(self._chunk_object(), [])
        body["usage"] = usage_body
        return sse(body)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


# Characters JSON may carry raw that str.splitlines (and so httpx's aiter_lines, which many SSE clients read with)
# takes for line ends: a token's text holding one would cut its event in two. Escaped, they are the same JSON string.
_LINE_BREAKING = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse(body: dict[str, Any]) -> bytes:
    data = msgspec.json.encode(body)
    for raw, escaped in _LINE_BREAKING:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
