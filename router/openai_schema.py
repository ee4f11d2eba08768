"""OpenAI request types, decoded strictly with msgspec: unknown fields ignored, null accepted where OpenAI allows it,
a known field with a bad type or value is a 400 naming the field."""

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pdserve.wire.sampling import SamplingParams
from pdserve_router.errors import APIError, bad_request

PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None  # -1 or 0: off
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    n: PositiveInt | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegativeInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # extension: prompt_token_ids and token_ids on each choice


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, strings, token ids, or lists of token ids: checked in prompts()
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    add_generation_prompt: bool | None = None  # extension, as in HF's apply_chat_template
    chat_template_kwargs: dict[str, Any] | None = None


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


def chat_messages_of(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: content flattened to text."""
    messages = []
    for index, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", param=f"messages[{index}].content")
            content = "".join(part.text for part in content if part.text)
        rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            rendered["name"] = message.name
        messages.append(rendered)
    return messages


def requested_max_tokens(request: SamplingFields) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def sampling_params_of(request: SamplingFields, max_tokens: int, choice_index: int) -> SamplingParams:
    """Worker sampling settings for one choice; a seeded request with n > 1 gets a distinct seed per choice."""
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
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=top_k,
            min_p=request.min_p or 0.0,
            seed=seed,
            stop=stop_list,
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=bool(request.ignore_eos),
            min_tokens=request.min_tokens or 0,
            logprobs=wants_logprobs,
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


def resolve_max_tokens(request: SamplingFields, prompt_len: int, max_model_len: int, max_tokens_limit: int) -> int:
    """The completion budget: asked for, or the context left (chat) / 16 (completions, as OpenAI's default)."""
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
