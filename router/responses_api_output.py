"""The Responses API's response object and its stream of typed events, built from the outputs a chat response is
built from: the chat builder parses the tool calls and renders the log-probabilities for both.

A stream opens with response.created and response.in_progress, sends each output item (a message's text, or a
function call's arguments) as added / delta / done events in output order, and ends with response.completed,
response.incomplete (max_output_tokens reached) or response.failed; it has no `[DONE]`."""

import itertools
import secrets
from typing import Any

import msgspec

from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.protocol import TokenEvent
from pdserve_router.errors import APIError
from pdserve_router.responses import ChoiceOutput, ResponseBuilder, ResponseOptions, chat_logprobs, sse
from pdserve_router.responses_api_request import ResponsesRequest


def responses_usage(usage_body: dict[str, Any]) -> dict[str, Any]:
    """A chat usage in the Responses API's words."""
    return {
        "input_tokens": usage_body["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage_body["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": usage_body["completion_tokens"],
        "output_tokens_details": usage_body.get("completion_tokens_details", {"reasoning_tokens": 0}),
        "total_tokens": usage_body["total_tokens"],
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message_item(text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant", "content": [part]}


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _item_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponsesBuilder:
    """The bodies of one Responses request (one choice); a stream's builder keeps the items streamed so far."""

    def __init__(self, request_id: str, created: int, model: str, tokenizer: PromptTokenizer, options: ResponseOptions,
                 request: ResponsesRequest) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.request = request
        self._chat = ResponseBuilder("chat", request_id, created, model, tokenizer, options)
        self._sequence = itertools.count()
        self._items: list[dict[str, Any]] = []  # output items streamed so far, in output order
        self._open: dict[str, Any] | None = None  # the item whose deltas are being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its function_call item
        self._error: APIError | None = None

    def usage(self, choices: list[ChoiceOutput]) -> dict[str, Any]:
        return self._chat.usage(choices)

    def reasoning_tokens(self, choices: list[ChoiceOutput]) -> int | None:
        return self._chat.reasoning_tokens(choices)

    def response(self, status: str, items: list[dict[str, Any]], usage_body: dict[str, Any] | None,
                 error: APIError | None = None) -> dict[str, Any]:
        """The response object; its settings are the request's, as OpenAI's echoes them."""
        request = self.request
        text_format = request.text.format if request.text is not None else None
        return {
            "id": self.request_id, "object": "response", "created_at": self.created, "status": status,
            "background": False,
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls, "model": self.model, "output": items,
            "parallel_tool_calls": request.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": msgspec.to_builtins(text_format) if text_format is not None else {"type": "text"}},
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
            "top_logprobs": request.top_logprobs, "truncation": "disabled",
            "usage": None if usage_body is None else responses_usage(usage_body), "user": request.user,
            "metadata": request.metadata or {},
        }

    @staticmethod
    def _status(choice: ChoiceOutput) -> str:
        return "incomplete" if choice.finish_reason == "length" else "completed"

    # --- a whole response ------------------------------------------------------------------------------------------

    def whole(self, choices: list[ChoiceOutput], usage_body: dict[str, Any]) -> dict[str, Any]:
        chat_choice = self._chat.whole(choices, usage_body)["choices"][0]
        message, status = chat_choice["message"], self._status(choices[0])
        calls = message.get("tool_calls", [])
        items = [_reasoning_item(message["reasoning_content"], status)] if message.get("reasoning_content") else []
        if message["content"] or not (calls or items):  # as a stream: an empty message only when nothing else came
            logprobs = chat_choice["logprobs"]["content"] if chat_choice["logprobs"] else []
            items.append(_message_item(message["content"] or "", logprobs, status))
        items += [_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed")
                  for call in calls]
        return self.response(status, items, usage_body)

    # --- a stream ---------------------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\n" + sse({"type": kind, "sequence_number": next(self._sequence), **fields})

    def head(self) -> bytes:
        opening = self.response("in_progress", [], None)
        return self._event("response.created", response=opening) + self._event("response.in_progress", response=opening)

    def chunk(self, choice: ChoiceOutput, event: TokenEvent, first: bool, text_offset: int) -> bytes | None:
        """The events for one worker event: reasoning and text deltas of the open item of their type, and function
        calls as they appear."""
        reasoning, content, calls = self._chat.stream_parts(choice, event)
        events: list[bytes] = []
        if reasoning:
            item = self._open_reasoning(events)
            item["content"][0]["text"] += reasoning
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                      output_index=len(self._items) - 1, content_index=0, delta=reasoning))
        if content:
            logprobs = []
            if self.options.logprobs:
                top = (event.top_token_ids, event.top_logprobs) if self.options.top_logprobs else (None, None)
                logprobs = chat_logprobs(self.tokenizer, event.token_ids, event.logprobs or [], *top)["content"]
            message = self._open_message(events)
            part = message["content"][0]
            part["text"] += content
            part["logprobs"] += logprobs
            events.append(self._event("response.output_text.delta", item_id=message["id"], output_index=len(self._items) - 1,
                                      content_index=0, delta=content, logprobs=logprobs))
        for call in calls:
            if "id" in call:  # a call's first delta
                self._close_open(events, "completed")
                self._open = self._calls[call["index"]] = _call_item(call["id"], call["function"]["name"], "", "in_progress")
                self._add(events, self._open)
            item, arguments = self._calls.get(call["index"]), call["function"]["arguments"]
            if item is not None and arguments:
                item["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self._items.index(item), delta=arguments))
        return b"".join(events) or None

    def failed(self, error: APIError) -> bytes:
        """Remembered for the stream's last event (response.failed)."""
        self._error = self._error or error
        return b""

    def tail(self, choices: list[ChoiceOutput], usage_body: dict[str, Any]) -> bytes:
        events: list[bytes] = []
        status = self._status(choices[0])
        if self._error is None and not self._items:  # nothing was said: one empty message, as a whole response has
            self._open_message(events)
        self._close_open(events, status)
        if self._error is not None:
            return b"".join(events) + self._event(
                "response.failed", response=self.response("failed", self._items, usage_body, self._error))
        return b"".join(events) + self._event(f"response.{status}", response=self.response(status, self._items, usage_body))

    def _add(self, events: list[bytes], item: dict[str, Any]) -> None:
        self._items.append(item)
        shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else item
        events.append(self._event("response.output_item.added", output_index=len(self._items) - 1, item=shown))

    def _open_reasoning(self, events: list[bytes]) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == "reasoning":
            return self._open
        self._close_open(events, "completed")
        self._open = _reasoning_item("", "in_progress")
        self._add(events, self._open)
        return self._open

    def _open_message(self, events: list[bytes]) -> dict[str, Any]:
        if self._open is not None and self._open["type"] == "message":
            return self._open
        self._close_open(events, "completed")
        self._open = _message_item("", [], "in_progress")
        self._add(events, self._open)
        events.append(self._event("response.content_part.added", item_id=self._open["id"],
                                  output_index=len(self._items) - 1, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return self._open

    def _close_open(self, events: list[bytes], status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self._items.index(item)
        if item["type"] == "reasoning":
            item["status"] = status
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            item["status"] = status
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=part["logprobs"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        else:
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
