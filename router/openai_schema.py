"""OpenAI request types, decoded strictly with msgspec: unknown fields ignored, null accepted where OpenAI allows it,
a known field with a bad type or value is a 400 naming the field, and an OpenAI field we do not implement is a 400
naming it (`check_unsupported`)."""

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pdserve.text.generation_defaults import GenerationDefaults
from pdserve.text.grammars import JSON_OBJECT_SCHEMA, json_schema_source
from pdserve.wire.sampling import MAX_TOP_LOGPROBS, Grammar, SamplingParams
from pdserve_router.errors import APIError, bad_request

PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
TopK = Annotated[int, Meta(ge=-1, le=2**31 - 1)]  # -1 or 0: off
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
LogitBias = dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]]  # token id (as text) -> bias
FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    n: PositiveInt | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegativeInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None  # an end-user id for abuse tracking: accepted, no effect here
    repetition_penalty: RepetitionPenalty | None = None  # extension, as vLLM's
    return_token_ids: bool | None = None  # extension: prompt_token_ids and token_ids on each choice
    # extension, as vLLM's: each prompt token's log-probability, rank and this many alternatives (not when streaming)
    prompt_logprobs: TopLogprobs | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids: checked in prompts()
    logprobs: TopLogprobs | None = None  # the chosen token's and this many alternatives' log-probabilities
    echo: bool | None = None
    best_of: PositiveInt | None = None  # only best_of == n (no extra candidates) is served
    suffix: str | None = None  # not served (no fill-in-the-middle)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this is the result of


class FunctionDefinition(msgspec.Struct, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow the schema when a grammar enforces the call


class Tool(msgspec.Struct, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI fields this server does not implement: a 400 naming them when set (see UNSUPPORTED_CHAT_FIELDS)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None
    add_generation_prompt: bool | None = None  # extension, as in HF's apply_chat_template
    chat_template_kwargs: dict[str, Any] | None = None


# Field -> why it is refused, for OpenAI chat fields that would change the answer and that we do not implement.
# (Bookkeeping fields that change nothing we return, such as user, metadata, service_tier, are accepted.)
UNSUPPORTED_CHAT_FIELDS = {
    "functions": "the deprecated `functions` API is not served; use `tools`",
    "function_call": "the deprecated `function_call` API is not served; use `tool_choice`",
    "audio": "audio output is not served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not served",
    "reasoning_effort": "this model has no reasoning-effort control",
    "verbosity": "this model has no verbosity control",
}


def check_unsupported(request: SamplingFields) -> None:
    """400 naming the first OpenAI field the request sets that this server does not implement."""
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("`prompt_logprobs` is not returned when streaming (as vLLM's)", param="prompt_logprobs",
                          code="unsupported_parameter")
    if isinstance(request, ChatCompletionRequest):
        for name, why in UNSUPPORTED_CHAT_FIELDS.items():
            if getattr(request, name) is not None:
                raise bad_request(f"`{name}` is not supported: {why}", param=name, code="unsupported_parameter")
        if request.modalities is not None and request.modalities != ["text"]:
            raise bad_request("only text output is served", param="modalities", code="unsupported_parameter")
        if request.store:
            raise bad_request("stored completions are not served", param="store", code="unsupported_parameter")
        if request.top_logprobs and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return
    assert isinstance(request, CompletionRequest)
    if request.suffix:
        raise bad_request("`suffix` (fill in the middle) is not supported", param="suffix", code="unsupported_parameter")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise bad_request("`best_of` other than n is not supported", param="best_of", code="unsupported_parameter")


_PATH = re.compile(r" - at `\$\.?([^`]*)`")


def decode_request(body: bytes, request_type: type[msgspec.Struct]) -> Any:
    """Decode a JSON body; any failure is a 400 whose `param` names the offending field."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as error:
        text = str(error)
        found = _PATH.search(text)
        param = found.group(1) if found else None
        if param is None and text.startswith("Object missing required field"):
            param = text.split("`")[1]
        raise bad_request(f"Invalid request: {text}", param=param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"Malformed JSON body: {error}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("JSON body is nested too deeply", code="invalid_json") from None


def prompts_of(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts a completion request holds, each a string or a list of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids", param="prompt"
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def chat_messages_of(request_messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: content flattened to text, tool calls and tool results kept."""
    messages = []
    for index, message in enumerate(request_messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", param=f"messages[{index}].content")
            content = "".join(part.text for part in content if part.text)
        # OpenAI's developer messages are what system messages were before them; templates know only system
        role = "system" if message.role == "developer" else message.role
        # An assistant turn of tool calls alone has null content (also when a client sent ""): DeepSeek-V3's and R1's
        # templates write the calls only when the content is none.
        kept = None if not content and message.tool_calls else content or ""
        rendered: dict[str, Any] = {"role": role, "content": kept}
        if message.name is not None:
            rendered["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request("only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls")
            rendered["tool_calls"] = [msgspec.to_builtins(call) for call in message.tool_calls]
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request("a tool message needs tool_call_id", param=f"messages[{index}].tool_call_id")
            rendered["tool_call_id"] = message.tool_call_id
        messages.append(rendered)
    return messages


def prompt_chars(request: SamplingFields) -> int:
    """Characters of text the request asks to tokenize (messages, tools, prompts): bounded before tokenizing."""
    if isinstance(request, ChatCompletionRequest):
        return messages_chars(request.messages, request.tools)
    assert isinstance(request, CompletionRequest)
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def messages_chars(messages: list[ChatMessage], tools: list[Tool] | None) -> int:
    total = 0
    for message in messages:
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content:
            total += sum(len(part.text or "") for part in message.content)
        total += sum(len(call.function.arguments) for call in message.tool_calls or [])
    return total + sum(len(msgspec.json.encode(tool)) for tool in tools or [])


def response_format_grammar(request: ChatCompletionRequest) -> Grammar | None:
    """The grammar `response_format` asks for (checked by the caller), or None for free text."""
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Grammar("json_schema", json_schema_source(JSON_OBJECT_SCHEMA))
    if response_format.json_schema is None:
        raise bad_request("response_format json_schema needs a `json_schema` object", param="response_format.json_schema")
    return Grammar("json_schema", json_schema_source(response_format.json_schema.schema or JSON_OBJECT_SCHEMA))


def requested_max_tokens(request: SamplingFields) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def logit_bias_of(request: SamplingFields, vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, value in (request.logit_bias or {}).items():
        if not key.isdigit() or not 0 <= int(key) < vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias")
        bias[int(key)] = value
    return bias


def top_logprobs_of(request: SamplingFields) -> int:
    if isinstance(request, ChatCompletionRequest):
        return request.top_logprobs or 0 if request.logprobs else 0
    return request.logprobs or 0


def echo_logprobs_of(request: SamplingFields) -> int | None:
    """Completions with `echo` and `logprobs`: the prompt's tokens get log-probabilities too (and as many
    alternatives as the output's)."""
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        return request.logprobs
    return None


def prompt_logprobs_of(request: SamplingFields) -> int | None:
    """The alternatives the workers compute at each prompt position, for an echo with logprobs or vLLM's
    `prompt_logprobs`, whichever asks for more; None: neither asks."""
    asked = [n for n in (echo_logprobs_of(request), request.prompt_logprobs) if n is not None]
    return max(asked) if asked else None


def check_prompt_logprobs_size(request: SamplingFields, prompt_tokens: int, max_tokens_limit: int) -> None:
    """An echoed prompt's log-probabilities are built into the response on the router's event loop, as an output's
    are: no more entries (tokens x (1 + alternatives)) than the longest output may carry, else a 400."""
    alternatives = prompt_logprobs_of(request)
    if alternatives is None:
        return
    entries, most = prompt_tokens * (1 + alternatives), max_tokens_limit * (1 + MAX_TOP_LOGPROBS)
    if entries > most:
        field = "prompt_logprobs" if request.prompt_logprobs == alternatives else "logprobs"
        raise bad_request(f"`{field}: {alternatives}` on a prompt of {prompt_tokens} tokens asks for {entries} "
                          f"log-probabilities; at most {most} (fewer alternatives or a shorter prompt)", param=field)


def sampling_params_of(request: SamplingFields, max_tokens: int, choice_index: int, defaults: GenerationDefaults,
                       logit_bias: dict[int, float], grammar: Grammar | None) -> SamplingParams:
    """Worker sampling settings for one choice; a seeded request with n > 1 gets a distinct seed per choice.
    Settings the request leaves out come from the model's generation_config.json (`defaults`), else OpenAI's."""
    stop = request.stop
    stop_list = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stop_list):
        raise bad_request("stop strings must be non-empty", param="stop")
    if len(stop_list) > 16:
        raise bad_request("at most 16 stop strings", param="stop")
    top_k = request.top_k if request.top_k not in (None, 0) else -1
    seed = None if request.seed is None else (request.seed + choice_index) % 2**63
    wants_logprobs = bool(request.logprobs) if isinstance(request, ChatCompletionRequest) else request.logprobs is not None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if request.temperature is None else request.temperature,
            top_p=defaults.top_p if request.top_p is None else request.top_p,
            top_k=defaults.top_k if request.top_k is None else top_k,
            min_p=request.min_p or 0.0,
            seed=seed,
            stop=stop_list,
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=bool(request.ignore_eos),
            min_tokens=request.min_tokens or 0,
            logprobs=wants_logprobs,
            top_logprobs=top_logprobs_of(request),
            prompt_logprobs=prompt_logprobs_of(request),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=defaults.repetition_penalty if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=logit_bias,
            grammar=grammar,
        )
    except ValueError as error:
        raise bad_request(str(error)) from None


def check_limits(request: SamplingFields, max_n: int, max_tokens_limit: int) -> None:
    n = request.n or 1
    if n > max_n:
        raise bad_request(f"n must be <= {max_n}, got {n}", param="n")
    max_tokens = requested_max_tokens(request)
    if max_tokens is not None and max_tokens > max_tokens_limit:
        param = "max_tokens" if request.max_tokens is not None else "max_completion_tokens"
        raise bad_request(f"{param} must be <= {max_tokens_limit}, got {max_tokens}", param=param)
    if request.min_tokens and max_tokens is not None and request.min_tokens > max_tokens:
        raise bad_request("min_tokens must be <= max_tokens", param="min_tokens")


def resolve_max_tokens(request: SamplingFields, prompt_len: int, max_model_len: int, max_tokens_limit: int,
                       default_max_tokens: int | None = None) -> int:
    """The completion budget: asked for, else generation_config.json's max_new_tokens, else the context left (chat)
    / 16 (completions, as OpenAI's default)."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len}.",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_len
    asked = requested_max_tokens(request)
    if asked is None:
        default = room if isinstance(request, ChatCompletionRequest) else 16
        if default_max_tokens is not None:
            default = default_max_tokens
        return max(1, min(default, room, max_tokens_limit))
    if asked > room:
        param = "max_tokens" if request.max_tokens is not None else "max_completion_tokens"
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} "
            f"and {param} asks for {asked}.",
            param=param,
            code="context_length_exceeded",
        )
    return asked


def include_usage_in_stream(request: SamplingFields) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a `prompt` (text) or `messages` (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[NonNegativeInt]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every 4xx and 5xx body."""

    error: ErrorDetail
