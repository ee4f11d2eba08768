"""One OpenAI request end to end: prompts -> token ids -> one generation per choice (through the dispatcher) ->
a whole JSON response or an SSE stream ending with `data: [DONE]`."""

import asyncio
import contextlib
import itertools
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdserve.text.generation_defaults import GenerationDefaults
from pdserve.text.grammars import FREE_TEXT_LARK, GrammarError, check_grammar
from pdserve.text.reasoning import ReasoningFormat
from pdserve.text.tokenizer import PromptError, PromptTokenizer
from pdserve.text.tool_calls import CallStyle, DeepSeekToolCalls, ToolSpec
from pdserve.wire.protocol import TokenEvent, token_gap
from pdserve.wire.sampling import Grammar, SamplingParams
from pdserve_router import openai_schema as schema
from pdserve_router.dispatch import Dispatcher, no_workers_error
from pdserve_router.errors import APIError
from pdserve_router.metrics import RouterMetrics
from pdserve_router.responses import ChoiceOutput, ResponseBuilder, ResponseOptions
from pdserve_router.responses_api_output import ResponsesBuilder
from pdserve_router.responses_api_request import ResponsesRequest
from pdserve_router.text_workers import TextWorkers

DISCONNECT_POLL_S = 0.5

Builder = ResponseBuilder | ResponsesBuilder  # what turns a request's outputs into bodies and stream events


class ReleasingStreamingResponse(StreamingResponse):
    """Releases the request's admission slot and closes the body however the response ends, even when the
    client left before the body was first iterated (an async generator never started runs no `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            await self.body_iterator.aclose()


@dataclass
class ChoicePlan:
    index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass
class RequestPlan:
    choices: list[ChoicePlan]
    options: ResponseOptions


@dataclass(frozen=True)
class ToolPlan:
    """What `tools` / `tool_choice` / `response_format` make of a chat request."""

    template_tools: list[dict] | None  # tools as the chat template renders them
    grammar: Grammar | None  # the constraint on the output, if any
    grammar_param: str | None  # the request field a grammar that does not compile is blamed on
    parse_tool_calls: bool
    max_tool_calls: int | None


class Serving:
    def __init__(self, tokenizer: PromptTokenizer, dispatcher: Dispatcher, metrics: RouterMetrics, model_name: str,
                 max_model_len: Callable[[], int | None], max_n: int, max_tokens_limit: int, retry_after_s: int,
                 text_workers: TextWorkers, max_prompt_chars: int, defaults: GenerationDefaults,
                 reasoning: ReasoningFormat | None) -> None:
        self.tokenizer = tokenizer
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.model_name = model_name
        self._max_model_len = max_model_len
        self._max_n = max_n
        self._max_tokens_limit = max_tokens_limit
        self._retry_after_s = retry_after_s
        self._text = text_workers
        self._max_prompt_chars = max_prompt_chars
        self._defaults = defaults
        self._tool_format = DeepSeekToolCalls.for_tokenizer(
            tokenizer.tokenizer, CallStyle.of_template(lambda messages: tokenizer.render_chat(messages, False)))
        self._reasoning = reasoning
        # Response ids: a random prefix per router process and a counter, unique across the routers sharing workers
        # (attempt ids sent to them derive from it) without a uuid4's system call per request.
        self._id_prefix = secrets.token_hex(8)
        self._id_numbers = itertools.count()

    # --- request -> choices ----------------------------------------------------------------------------------------

    def _check_model(self, request: schema.SamplingFields) -> None:
        if request.model != self.model_name:
            raise APIError(404, f"The model `{request.model}` does not exist; this router serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def _check_request(self, request: schema.SamplingFields) -> int:
        """Everything decided before any tokenization starts: model, limits, unsupported fields, prompt size (the
        prompt's characters, returned)."""
        self._check_model(request)
        schema.check_limits(request, self._max_n, self._max_tokens_limit)
        schema.check_unsupported(request)
        chat = isinstance(request, schema.ChatCompletionRequest)
        chars = schema.prompt_chars(request)
        self._check_prompt_chars(chars, "messages" if chat else "prompt")
        return chars

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        if chars > self._max_prompt_chars:
            raise schema.bad_request(
                f"the prompt has {chars} characters; this router tokenizes at most {self._max_prompt_chars}",
                param=param, code="prompt_too_long")

    def _plan_choices(self, request: schema.SamplingFields, prompts: list[list[int]],
                      grammar: Grammar | None) -> list[ChoicePlan]:
        max_model_len = self._max_model_len()
        if max_model_len is None:
            raise no_workers_error(self._retry_after_s)
        n = request.n or 1
        logit_bias = schema.logit_bias_of(request, self.tokenizer.vocab_size)
        plans = []
        for prompt_index, prompt_token_ids in enumerate(prompts):
            if not prompt_token_ids:
                raise schema.bad_request("the prompt is empty after tokenization", param="prompt")
            max_tokens = schema.resolve_max_tokens(request, len(prompt_token_ids), max_model_len, self._max_tokens_limit,
                                                   self._defaults.max_tokens)
            schema.check_prompt_logprobs_size(request, len(prompt_token_ids), self._max_tokens_limit)
            for j in range(n):
                sampling = schema.sampling_params_of(request, max_tokens, j, self._defaults, logit_bias, grammar)
                plans.append(ChoicePlan(prompt_index * n + j, prompt_token_ids, sampling))
        return plans

    def _options(self, request: schema.SamplingFields, **kwargs) -> ResponseOptions:
        if isinstance(request, schema.ChatCompletionRequest):
            wants_logprobs = bool(request.logprobs)
        else:
            wants_logprobs = request.logprobs is not None
        return ResponseOptions(logprobs=wants_logprobs, top_logprobs=schema.top_logprobs_of(request),
                               return_token_ids=bool(request.return_token_ids), n=request.n or 1,
                               include_usage=schema.include_usage_in_stream(request),
                               prompt_logprobs=request.prompt_logprobs, **kwargs)

    async def plan_completion(self, request: schema.CompletionRequest) -> RequestPlan:
        chars = self._check_request(request)
        prompts = schema.prompts_of(request)
        token_prompts = await self._text.run(
            chars, lambda: [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts])
        for prompt in token_prompts:
            if outside := [t for t in prompt if not 0 <= t < self.tokenizer.vocab_size]:
                raise schema.bad_request(f"prompt token id {outside[0]} is outside the vocabulary "
                                         f"[0, {self.tokenizer.vocab_size})", param="prompt")
        echo_texts = None
        if request.echo:
            echo_texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        return RequestPlan(self._plan_choices(request, token_prompts, None), self._options(request, echo_texts=echo_texts))

    async def plan_chat(self, request: schema.ChatCompletionRequest) -> RequestPlan:
        chars = self._check_request(request)
        tools = self._tool_plan(request)
        messages = schema.chat_messages_of(request.messages)
        add_generation_prompt = True if request.add_generation_prompt is None else request.add_generation_prompt
        template_kwargs = dict(request.chat_template_kwargs or {})
        if tools.template_tools is not None:
            template_kwargs["tools"] = tools.template_tools

        def tokenize() -> list[int]:
            if tools.grammar is not None:
                try:
                    check_grammar(tools.grammar.kind, tools.grammar.source)
                except GrammarError as error:
                    raise schema.bad_request(f"the output constraint does not compile: {error}", param=tools.grammar_param)
            try:
                return self.tokenizer.encode_chat(messages, add_generation_prompt, **template_kwargs)
            except PromptError as error:
                raise schema.bad_request(str(error), param=error.param) from None

        # A grammar compiles on a thread whatever the prompt's size: that can take milliseconds.
        prompt = await self._text.run(chars if tools.grammar is None else math.inf, tokenize)
        grammar, reasoning_opened = tools.grammar, False
        if self._reasoning is not None:
            reasoning_opened = self._reasoning.opened_by(prompt)
            if reasoning_opened and grammar is not None:  # the model thinks first, then answers as constrained
                grammar = Grammar("lark", self._reasoning.after_reasoning(grammar.kind, grammar.source))
        tool_style = self._tool_format.style if tools.parse_tool_calls and self._tool_format is not None else None
        options = self._options(request, tool_style=tool_style, max_tool_calls=tools.max_tool_calls,
                                reasoning=self._reasoning, reasoning_opened=reasoning_opened)
        return RequestPlan(self._plan_choices(request, [prompt], grammar), options)

    def _tool_plan(self, request: schema.ChatCompletionRequest) -> ToolPlan:
        response_grammar = schema.response_format_grammar(request)
        choice = request.tool_choice
        if not request.tools:
            if choice not in (None, "none", "auto"):
                raise schema.bad_request("tool_choice names a tool, but the request has no tools", param="tool_choice")
            return ToolPlan(None, response_grammar, "response_format", False, None)
        if self._tool_format is None:
            raise schema.bad_request("this model's tokenizer has no tool-call markers; it cannot call tools", param="tools")
        template_tools = [msgspec.to_builtins(tool) for tool in request.tools]
        specs = [ToolSpec(t.function.name, t.function.parameters or {"type": "object"}) for t in request.tools]
        parallel = request.parallel_tool_calls is not False
        max_calls = None if parallel else 1
        if choice is None or choice == "auto":
            return ToolPlan(template_tools, response_grammar, "response_format", response_grammar is None, max_calls)
        if response_grammar is not None:
            raise schema.bad_request("response_format cannot be combined with tool_choice other than auto",
                                     param="response_format")
        if choice == "none":
            return ToolPlan(template_tools, Grammar("lark", FREE_TEXT_LARK), "tool_choice", False, None)
        if choice != "required":
            assert isinstance(choice, schema.NamedToolChoice)
            specs = [spec for spec in specs if spec.name == choice.function.name]
            if not specs:
                raise schema.bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                         param="tool_choice.function.name")
        return ToolPlan(template_tools, Grammar("lark", self._tool_format.grammar(specs, parallel)), "tools", True, max_calls)

    # --- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------------------------

    async def tokenize(self, request: schema.TokenizeRequest) -> dict:
        if request.model is not None:
            self._check_model(request)  # type: ignore[arg-type]
        if (request.prompt is None) == (request.messages is None):
            raise schema.bad_request("give exactly one of `prompt` or `messages`", param="prompt")
        if request.prompt is not None:
            self._check_prompt_chars(len(request.prompt), "prompt")
            token_ids = await self._text.run(len(request.prompt), self.tokenizer.encode, request.prompt,
                                             request.add_special_tokens)
        else:
            assert request.messages is not None
            chars = schema.messages_chars(request.messages, request.tools)
            self._check_prompt_chars(chars, "messages")
            messages = schema.chat_messages_of(request.messages)
            kwargs = dict(request.chat_template_kwargs or {})
            if request.tools:
                kwargs["tools"] = [msgspec.to_builtins(tool) for tool in request.tools]
            try:
                token_ids = await self._text.run(chars, self.tokenizer.encode_chat, messages, request.add_generation_prompt,
                                                 **kwargs)
            except PromptError as error:
                raise schema.bad_request(str(error), param=error.param) from None
        body: dict = {"count": len(token_ids), "max_model_len": self._max_model_len(), "tokens": token_ids}
        if request.return_token_strs:
            body["token_strs"] = [self.tokenizer.tokenizer.id_to_token(t) for t in token_ids]
        return body

    async def detokenize(self, request: schema.DetokenizeRequest) -> dict:
        if request.model is not None:
            self._check_model(request)  # type: ignore[arg-type]
        if outside := [t for t in request.tokens if t >= self.tokenizer.vocab_size]:
            raise schema.bad_request(f"token id {outside[0]} is outside the vocabulary [0, {self.tokenizer.vocab_size})",
                                     param="tokens")
        return {"prompt": await self._text.run(math.inf, self.tokenizer.decode, request.tokens)}

    # --- choices -> response ---------------------------------------------------------------------------------------

    def response_id(self, prefix: str) -> str:
        return f"{prefix}{self._id_prefix}{next(self._id_numbers):016x}"

    def builder(self, kind: str, plan: RequestPlan, responses_request: ResponsesRequest | None = None) -> Builder:
        """The response builder of a completions, chat or Responses (`kind` completion, chat, responses) request."""
        created = int(time.time())
        if kind == "responses":
            assert responses_request is not None
            return ResponsesBuilder(self.response_id("resp_"), created, self.model_name, self.tokenizer, plan.options,
                                    responses_request)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return ResponseBuilder(kind, self.response_id(prefix), created, self.model_name, self.tokenizer, plan.options)

    async def respond(self, request: schema.SamplingFields, plan: RequestPlan, builder: Builder, http_request: Request,
                      arrival_s: float, on_done: Callable[[], None]) -> Response:
        if not self.dispatcher.can_serve():
            raise no_workers_error(self._retry_after_s)
        plans = plan.choices
        outputs = [ChoiceOutput(plan.index, plan.prompt_token_ids) for plan in plans]
        events = self._merged_events(builder.request_id, plans, arrival_s)
        # The body's id as OpenAI's x-request-id (the SDK's `_request_id`); workers' logs name `<id>-<choice>`.
        headers = {"x-request-id": builder.request_id}
        if request.stream:
            stream = self._stream(builder, outputs, events, arrival_s)
            return ReleasingStreamingResponse(stream, on_done, media_type="text/event-stream",
                                              headers={"Cache-Control": "no-cache", **headers})
        try:
            await self._collect_unless_disconnected(outputs, events, http_request, arrival_s)
        finally:
            on_done()
            self._observe_lengths(outputs, builder)
        failed = next((o for o in outputs if o.finish_reason == "error"), None)
        if failed is not None:
            self.metrics.count_request("error")
            raise APIError(502, f"the worker failed while generating: {failed.error}", code="worker_error", type="server_error")
        self.metrics.count_request("ok")
        return Response(msgspec.json.encode(builder.whole(outputs, builder.usage(outputs))), media_type="application/json",
                        headers=headers)

    def _observe_lengths(self, outputs: list[ChoiceOutput], builder: Builder) -> None:
        """Each sequence's prompt and generated lengths, however it ended: the work it took is what pools are sized by;
        and a thinking model's reasoning tokens."""
        for output in outputs:
            self.metrics.observe_prompt_tokens(len(output.prompt_token_ids))
            self.metrics.observe_generation_tokens(len(output.token_ids))
        if reasoning := builder.reasoning_tokens(outputs):
            self.metrics.count_reasoning_tokens(reasoning)

    def _merged_events(self, request_id: str, plans: list[ChoicePlan],
                       arrival_s: float) -> AsyncIterator[list[tuple[int, TokenEvent]]]:
        """Events of all choices as (choice position, event), interleaved as they come, in batches of what has arrived
        (what a worker sent in one read comes as one batch: the response writes it at once); leaving early cancels
        (and so aborts) every choice. One choice's events are the dispatcher's own."""
        if len(plans) == 1:
            plan = plans[0]
            return self.dispatcher.generate(f"{request_id}-{plan.index}", plan.prompt_token_ids, plan.sampling,
                                            arrival_s)
        return self._interleaved(request_id, plans, arrival_s)

    async def _interleaved(self, request_id: str, plans: list[ChoicePlan],
                           arrival_s: float) -> AsyncIterator[list[tuple[int, TokenEvent]]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(position: int, plan: ChoicePlan) -> None:
            try:
                choice_events = self.dispatcher.generate(f"{request_id}-{plan.index}", plan.prompt_token_ids,
                                                         plan.sampling, arrival_s, position)
                async with contextlib.aclosing(choice_events):
                    async for batch in choice_events:
                        queue.put_nowait(batch)
                queue.put_nowait(None)
            except APIError as error:
                queue.put_nowait(error)

        tasks = [asyncio.create_task(pump(position, plan)) for position, plan in enumerate(plans)]
        try:
            remaining = len(tasks)
            while remaining:
                merged: list[tuple[int, TokenEvent]] = []
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for item in items:
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, APIError):
                        raise item
                    else:
                        merged += item
                if merged:
                    yield merged
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _absorb(self, output: ChoiceOutput, event: TokenEvent, last_token_s: dict[int, float], arrival_s: float) -> None:
        now = time.monotonic()
        if event.token_ids:
            previous = last_token_s.get(output.index)
            if previous is None:
                self.metrics.observe_ttft(now - arrival_s)
            self.metrics.observe_itl(*token_gap(previous, now, len(event.token_ids)))
            last_token_s[output.index] = now
        output.text += event.text
        output.token_ids.extend(event.token_ids)
        if event.logprobs:
            output.logprobs.extend(event.logprobs)
        if event.top_token_ids and event.top_logprobs:
            output.top_token_ids.extend(event.top_token_ids)
            output.top_logprobs.extend(event.top_logprobs)
        output.cached_tokens = max(output.cached_tokens, event.cached_tokens)
        if event.prompt_logprobs is not None:
            output.prompt_logprobs = event.prompt_logprobs
            output.prompt_ranks = event.prompt_ranks or []
            output.prompt_top_token_ids = event.prompt_top_token_ids or []
            output.prompt_top_logprobs = event.prompt_top_logprobs or []
        if event.finish_reason is not None:
            output.finish_reason = event.finish_reason
            output.error = event.error

    async def _collect_unless_disconnected(self, outputs, events, http_request: Request, arrival_s: float) -> None:
        """Collects the events in this task. Every DISCONNECT_POLL_S a timer looks whether the client left (the look
        takes a task of its own, made only then: most requests end before the first) and if so cancels this task."""
        collecting = asyncio.current_task()
        assert collecting is not None
        loop = asyncio.get_running_loop()
        last_token_s: dict[int, float] = {}
        left = False
        looking: asyncio.Task | None = None

        async def look() -> None:
            nonlocal left, timer
            if await http_request.is_disconnected():
                left = True
                collecting.cancel()
            else:
                timer = loop.call_later(DISCONNECT_POLL_S, start_look)

        def start_look() -> None:
            nonlocal looking
            looking = asyncio.create_task(look())

        timer = loop.call_later(DISCONNECT_POLL_S, start_look)
        try:
            async with contextlib.aclosing(events):
                async for batch in events:
                    for position, event in batch:
                        self._absorb(outputs[position], event, last_token_s, arrival_s)
        except asyncio.CancelledError:
            if not left:
                raise
            collecting.uncancel()
            self.metrics.count_request("client_disconnected")
            raise APIError(499, "client disconnected", code="client_disconnected") from None
        finally:
            timer.cancel()
            if looking is not None:
                looking.cancel()
        self.metrics.observe_e2e(time.monotonic() - arrival_s)

    async def _stream(self, builder: Builder, outputs: list[ChoiceOutput], events,
                      arrival_s: float) -> AsyncIterator[bytes]:
        last_token_s: dict[int, float] = {}
        status = "client_disconnected"  # unless the loop below reaches an end
        try:
            if head := builder.head():
                yield head
            try:
                async with contextlib.aclosing(events):  # leaving early must cancel (and abort) every choice now
                    async for batch in events:
                        chunks = []
                        for position, event in batch:
                            output = outputs[position]
                            first = output.index not in last_token_s and not output.token_ids and not output.text
                            text_offset = len(output.text)
                            self._absorb(output, event, last_token_s, arrival_s)
                            if event.finish_reason == "error":
                                chunks.append(builder.failed(APIError(502, f"the worker failed while generating: {event.error}",
                                                                      code="worker_error", type="server_error")))
                            elif event.token_ids or event.text or event.finish_reason is not None:
                                chunk = builder.chunk(output, event, first, text_offset)
                                if chunk is not None:
                                    chunks.append(chunk)
                        if chunks:
                            yield b"".join(chunks)  # what arrived together goes out in one write
                status = "error" if any(o.finish_reason == "error" for o in outputs) else "ok"
            except APIError as error:
                status = "error"
                yield builder.failed(error)
            yield builder.tail(outputs, builder.usage(outputs))
            self.metrics.observe_e2e(time.monotonic() - arrival_s)
        finally:
            self.metrics.count_request(status)
            self._observe_lengths(outputs, builder)
