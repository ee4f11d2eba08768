"""OpenAI's Responses API (`POST /v1/responses`), stateless: a request is decoded strictly (as the chat request is)
and becomes the chat completion request it means, which the router plans and serves as any other.

Served: `input` as text or items (messages of the user, system, developer and assistant roles with text parts;
function calls and their outputs), `instructions`, function tools and `tool_choice`, `text.format` (text, JSON
object, JSON schema), `max_output_tokens`, sampling, `top_logprobs` and the output text's log-probabilities, streaming,
and the sampling extensions of the chat API (seed, top_k, min_p, repetition_penalty, stop, ignore_eos, min_tokens, ...).
Nothing is stored (the response says `store: false`), so what needs a stored response or conversation is a 400
naming it, as is every other field and item type that would change the answer and is not served."""

from typing import Any, Literal

import msgspec

from pdserve_router import openai_schema as schema
from pdserve_router.errors import APIError, bad_request


class FunctionTool(msgspec.Struct, kw_only=True):
    """A function tool as the Responses API gives it: flat, not under `function` as chat's."""

    type: Literal["function"]
    name: schema.FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema: the schema's name
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]  # items, checked one by one in `messages_of` for errors that name them
    instructions: str | None = None
    max_output_tokens: schema.PositiveInt | None = None
    temperature: schema.Temperature | None = None
    top_p: schema.TopP | None = None
    top_logprobs: schema.TopLogprobs | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" adds them; the rest name items never made here
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no effect here
    tools: list[dict[str, Any]] | None = None  # checked in `tools_of`, to name a tool type that is not served
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: schema.PositiveInt | None = None  # caps built-in tool calls, of which there are none here
    text: TextConfig | None = None
    store: bool | None = None  # accepted; nothing is stored (the response says store: false)
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # OpenAI fields this server does not implement: a 400 naming them when set (UNSUPPORTED)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    context_management: Any = None
    # Extensions, as in the chat API
    seed: schema.Seed | None = None
    top_k: schema.TopK | None = None
    min_p: schema.MinP | None = None
    repetition_penalty: schema.RepetitionPenalty | None = None
    presence_penalty: schema.Penalty | None = None
    frequency_penalty: schema.Penalty | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[schema.NonNegativeInt] | None = None
    ignore_eos: bool | None = None
    min_tokens: schema.NonNegativeInt | None = None
    logit_bias: schema.LogitBias | None = None
    chat_template_kwargs: dict[str, Any] | None = None


UNSUPPORTED = {
    "previous_response_id": "responses are not stored; send the whole conversation as `input`",
    "conversation": "conversations are not stored; send the whole conversation as `input`",
    "prompt": "stored prompt templates are not served",
    "background": "background responses are not served",
    "reasoning": "this model has no reasoning control",
    "context_management": "context management is not served",
}

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


def wants_logprobs(request: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (request.include or []) or bool(request.top_logprobs)


def chat_request_of(request: ResponsesRequest) -> schema.ChatCompletionRequest:
    """The chat completion request `request` means; a 400 naming what it holds that is not served."""
    for name, why in UNSUPPORTED.items():
        value = getattr(request, name)
        if isinstance(value, dict):  # reasoning: {"effort": null} asks for nothing
            value = {key: item for key, item in value.items() if item is not None} or None
        if value is not None and value is not False:
            raise bad_request(f"`{name}` is not supported: {why}", param=name, code="unsupported_parameter")
    if request.truncation == "auto":
        raise bad_request("`truncation: auto` is not served: a prompt over the context is a 400", param="truncation",
                          code="unsupported_parameter")
    text = request.text or TextConfig()
    if text.verbosity is not None:
        raise bad_request("`text.verbosity` is not supported: this model has no verbosity control",
                          param="text.verbosity", code="unsupported_parameter")
    logprobs = wants_logprobs(request)
    return schema.ChatCompletionRequest(
        model=request.model, messages=messages_of(request), max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, logprobs=logprobs or None,
        top_logprobs=request.top_logprobs if logprobs else None, stream=request.stream, tools=tools_of(request),
        tool_choice=tool_choice_of(request.tool_choice), parallel_tool_calls=request.parallel_tool_calls,
        response_format=response_format_of(text.format), user=request.user, seed=request.seed, top_k=request.top_k,
        min_p=request.min_p, repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, stop=request.stop, stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos, min_tokens=request.min_tokens, logit_bias=request.logit_bias,
        chat_template_kwargs=request.chat_template_kwargs)


def messages_of(request: ResponsesRequest) -> list[schema.ChatMessage]:
    """`instructions` and `input` as chat messages: a function call joins the assistant turn before it (or starts
    one), and a function call's output is a tool message."""
    messages = [] if request.instructions is None else [schema.ChatMessage(role="system", content=request.instructions)]
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    if not items:
        raise bad_request("input must not be empty", param="input")
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, f"input[{index}]"))
        elif kind == "function_call":
            call = schema.ToolCall(id=_text_field(item, "call_id", index), function=schema.FunctionCall(
                name=_text_field(item, "name", index), arguments=_text_field(item, "arguments", index)))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(schema.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "reasoning":
            continue  # a past turn's reasoning: not sent back to the model, as DeepSeek's templates drop it too
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text_of(output, f"input[{index}].output")
            messages.append(schema.ChatMessage(role="tool", content=content,
                                               tool_call_id=_text_field(item, "call_id", index)))
        else:
            raise bad_request(f"input items of type `{kind}` are not served (only messages, function calls and their "
                              "outputs, and reasoning, which is dropped)", param=f"input[{index}].type",
                              code="unsupported_parameter")
    return messages


def _message(item: dict[str, Any], where: str) -> schema.ChatMessage:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(f"a message's role must be user, system, developer or assistant, got {role!r}",
                          param=f"{where}.role")
    content = item.get("content")
    return schema.ChatMessage(role=role, content=content if isinstance(content, str) else _text_of(content, f"{where}.content"))


def _text_of(parts: Any, where: str) -> str:
    """The text of a list of content parts; a part that is not text (an image, a file, audio) is a 400."""
    if not isinstance(parts, list):
        raise bad_request("content must be a string or a list of content parts", param=where)
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            texts.append(part.get("refusal") or "")
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise bad_request(f"only text content parts are served, got {kind!r}", param=f"{where}[{index}]",
                              code="unsupported_parameter" if kind else None)
    return "".join(texts)


def _text_field(item: dict[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"a {item.get('type')} item needs `{name}` as a string", param=f"input[{index}].{name}")
    return value


def tools_of(request: ResponsesRequest) -> list[schema.Tool] | None:
    if not request.tools:
        return None
    tools = []
    for index, tool in enumerate(request.tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools of type `{tool.get('type')}` are not served (only function tools)",
                              param=f"tools[{index}].type", code="unsupported_parameter")
        try:
            function = msgspec.convert(tool, FunctionTool)
        except msgspec.ValidationError as error:
            raise bad_request(f"Invalid request: {error}", param=f"tools[{index}]") from None
        tools.append(schema.Tool(type="function", function=schema.FunctionDefinition(
            name=function.name, description=function.description, parameters=function.parameters,
            strict=function.strict)))
    return tools


def tool_choice_of(choice: str | dict[str, Any] | None) -> Literal["none", "auto", "required"] | schema.NamedToolChoice | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice  # type: ignore[return-value]
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return schema.NamedToolChoice(type="function", function=schema.NamedFunction(name=choice["name"]))
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise bad_request(f"tool_choice {kind!r} is not served (none, auto, required, or a function by name)",
                      param="tool_choice", code="unsupported_parameter")


def response_format_of(text_format: TextFormat | None) -> schema.ResponseFormat | None:
    if text_format is None or text_format.type != "json_schema":
        return None if text_format is None else schema.ResponseFormat(type=text_format.type)
    if text_format.schema is None:
        raise bad_request("text.format json_schema needs a `schema`", param="text.format.schema")
    return schema.ResponseFormat(type="json_schema", json_schema=schema.JsonSchemaFormat(
        name=text_format.name or "response", schema=text_format.schema, description=text_format.description,
        strict=text_format.strict))


# What the chat request's errors call a field, and what the Responses request calls it.
_FIELD_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
                ("response_format", "text.format"), ("messages", "input"))


def as_responses_error(error: APIError) -> APIError:
    """A chat request's error in the Responses request's words: the field it names, as the client wrote it."""
    param, message = error.param, error.message
    for chat_name, name in _FIELD_NAMES:
        message = message.replace(chat_name, name)
        if param is not None and param.startswith(chat_name):
            param = name  # an index into messages is not one into input (instructions and calls shift it)
    if param == error.param and message == error.message:
        return error
    return APIError(error.status, message, param, error.code, error.type, error.headers)
