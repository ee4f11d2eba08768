"""Unchanged OpenAI clients against a real prefill/decode cluster on a tiny V3 model with DeepSeek's real tokenizer:
structured outputs through the SDK's `parse`, tool calls (streamed, and in LangChain's and the openai-agents SDK's
agent loops), real top logprobs, and a huge prompt's tokenization that never stalls another stream.

The tiny model's free output is noise, so tool calls come from `tool_choice` required or named (a grammar makes the
model write one), final answers from `tool_choice: none`, and everything is greedy, hence deterministic."""

import asyncio
import json
import threading
import time
from typing import Literal

import jsonschema
import openai
import pytest
from probes import HTTP, wait_for
from pydantic import BaseModel, Field

from pdserve import LLM, SamplingParams
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.text.grammars import json_schema_source
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.sampling import Grammar

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
QUESTIONS = ["What is the weather in Paris?", "Is it raining in Rome?", "Describe the sky today.", "Weather report, please.",
             "Give me a forecast for tomorrow."]


class Weather(BaseModel):
    city: str = Field(max_length=10)
    temperature_c: int = Field(ge=-50, le=60)
    sky: Literal["sunny", "cloudy", "rain"]


@pytest.fixture(scope="module")
def cluster(tiny_v3_deepseek):
    cfg = ClusterConfig(model=tiny_v3_deepseek, port=0, num_prefill=1, num_decode=1,
                        worker_args=("--dtype", "float32", "--num-pages", "512"),
                        router_args=("--max-body-bytes", str(8 * 2**20), "--max-prompt-chars", str(6 * 2**20)))
    with InProcessCluster(cfg) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_sdk_parse_returns_the_pydantic_model_for_every_prompt(client, model):
    for question in QUESTIONS:
        completion = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": question}],
                                                   response_format=Weather, temperature=0, max_tokens=100)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Weather) and completion.choices[0].finish_reason == "stop"


def test_constrained_greedy_tokens_across_prefill_and_decode_equal_one_engine(client, model, tiny_v3_deepseek):
    """The decode rank re-creates the matcher and advances it by the prefill rank's first token: the tokens are the
    offline engine's (a matcher left at the start would reject the second token's JSON)."""
    schema = {**Weather.model_json_schema(), "additionalProperties": False}
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}},
        extra_body={"return_token_ids": True})
    choice = response.choices[0].model_extra
    offline = LLM(tiny_v3_deepseek, progress=False).generate(
        prompt_token_ids=[choice["prompt_token_ids"]],
        sampling=SamplingParams(max_tokens=100, temperature=0.0, grammar=Grammar("json_schema", json_schema_source(schema))))
    assert choice["token_ids"] == offline[0].token_ids
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_json_object_mode_gives_a_json_object(client, model):
    response = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}],
                                              response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    else:  # an unbounded object may run to max_tokens, as with OpenAI; what came is still a JSON prefix
        assert response.choices[0].message.content.startswith("{")


def test_streamed_required_tool_call_assembles_to_a_valid_call(client, model):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTIONS[0]}], tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60, stream=True)
    calls, finish, chunks = {}, None, 0
    for chunk in stream:
        chunks += 1
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or delta.id
            entry["name"] = entry["name"] or (delta.function.name if delta.function else None)
            entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and chunks > 2
    call = calls[0]
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    assert call["id"].startswith("call_")


def test_named_tool_choice_calls_that_tool_and_history_with_tool_results_is_accepted(client, model):
    messages = [{"role": "user", "content": "Time in CET?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and first.choices[0].message.content is None
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice="none", temperature=0, max_tokens=20)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_top_logprobs_whole_and_streamed(client, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=6,
                  logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(whole) == 6
    for entry in whole:
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])  # greedy: the chosen token is the most likely
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [len(e.top_logprobs) for e in streamed] == [5] * 6
    completion = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    assert [len(top) for top in completion.choices[0].logprobs.top_logprobs] == [3] * 4


def test_logit_bias_penalties_and_echo_change_the_output_as_in_the_engine(client, model, tiny_v3_deepseek):
    base = dict(model=model, prompt="The harbor town", max_tokens=8, temperature=0)
    plain = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    forced = client.completions.create(**base, logit_bias={"4": 100}, extra_body={"ignore_eos": True}).choices[0].text
    llm = LLM(tiny_v3_deepseek, progress=False)
    assert forced == llm.engine.tokenizer.decode([4] * 8) and forced != plain
    # A bias of 34 makes token 4 win from the fourth token on; the penalties stop it after two, as the engine does.
    biased = client.completions.create(**base, logit_bias={"4": 34}, extra_body={"ignore_eos": True, "return_token_ids": True})
    penalized = client.completions.create(**base, logit_bias={"4": 34}, frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    repeated = client.completions.create(**base, logit_bias={"4": 34},
                                         extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 2.0})
    prompt = biased.choices[0].model_extra["prompt_token_ids"]

    def offline(**penalties) -> list[int]:
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={4: 34.0}, **penalties)
        return llm.generate(prompt_token_ids=[prompt], sampling=sampling)[0].token_ids

    with_penalties = offline(frequency_penalty=2.0, presence_penalty=2.0)
    assert biased.choices[0].model_extra["token_ids"] == offline() != with_penalties
    assert penalized.choices[0].model_extra["token_ids"] == with_penalties
    assert repeated.choices[0].model_extra["token_ids"] == offline(repetition_penalty=2.0) != offline()
    echoed = client.completions.create(**base, echo=True, extra_body={"ignore_eos": True}).choices[0].text
    assert echoed == "The harbor town" + plain


def test_langchain_two_tool_agent_loop_reaches_a_final_answer(cluster, model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """Current time in a zone."""
        return f"12:00 {zone}"

    tools = {"get_weather": get_weather, "get_time": get_time}
    llm = ChatOpenAI(model=model, base_url=cluster.url + "/v1", api_key="unused", temperature=0, max_tokens=60,
                     max_retries=0, timeout=120)
    messages = [HumanMessage("What is the weather in Paris, and the time in CET?")]
    for name in ("get_weather", "get_time"):  # the agent's two tool steps
        reply = llm.bind_tools(list(tools.values()), tool_choice=name, parallel_tool_calls=False).invoke(messages)
        assert [call["name"] for call in reply.tool_calls] == [name]
        messages += [reply, ToolMessage(tools[name].invoke(reply.tool_calls[0]["args"]), tool_call_id=reply.tool_calls[0]["id"])]
    final = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(messages)
    assert final.tool_calls == [] and isinstance(final.content, str)
    assert final.response_metadata["finish_reason"] in ("stop", "length")


def agents_weather_tool():
    """An openai-agents function tool, and the cities it was called with."""
    from agents import function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    return get_weather, cities


def test_openai_agents_sdk_runs_a_function_tool_to_a_final_output(cluster, model):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner

    get_weather, cities = agents_weather_tool()

    async def run():
        # The client is closed in the loop it ran in: left to the garbage collector, it would try to close itself on
        # a closed loop during some later test, whose log check would then fail.
        async with openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            agent = Agent(
                name="weather", instructions="Use the tool, then answer.", tools=[get_weather],
                model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                # required on the first turn; the SDK resets tool_choice after a tool call, so the next turn answers
                model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40,
                                             parallel_tool_calls=False),
            )
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert cities and cities[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, str)


def test_a_huge_prompt_being_tokenized_does_not_stall_another_stream(cluster, model):
    arrivals: list[float] = []
    stop = threading.Event()

    def read_stream() -> None:
        body = {"model": model, "prompt": "Stream on", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with HTTP.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                if stop.is_set():
                    return

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(arrivals) >= 3, 60, "the stream's first tokens")
        started = time.monotonic()
        huge = ("lorem ipsum dolor sit amet " * (4 * 2**20 // 27 + 1))[: 4 * 2**20]
        response = HTTP.post(cluster.url + "/v1/completions", json={"model": model, "prompt": huge, "max_tokens": 1},
                              timeout=120)
        finished = time.monotonic()
    finally:
        stop.set()
        reader.join(timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"  # it was tokenized whole
    during = [t for t in arrivals if started < t < finished]
    assert len(during) >= 3, f"{len(during)} tokens arrived in the {finished - started:.1f} s of tokenization"


# --- the Responses API ---------------------------------------------------------------------------------------------

def flat_tool(tool: dict) -> dict:
    """A chat tool as the Responses API takes it."""
    return {"type": "function", **tool["function"]}


def test_responses_api_text_equals_chat_and_streams_the_same_text(client, model):
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    kwargs = dict(model=model, instructions="Be brief.", input="Hello", temperature=0, max_output_tokens=12,
                  extra_body={"ignore_eos": True})
    response = client.responses.create(**kwargs)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == 12
    assert response.id.startswith("resp_") and response.store is False and response._request_id == response.id
    # A developer message is a system message, and the input may be items.
    items = client.responses.create(**{**kwargs, "instructions": None, "input": [
        {"role": "developer", "content": "Be brief."}, {"type": "message", "role": "user",
                                                        "content": [{"type": "input_text", "text": "Hello"}]}]})
    assert items.output_text == response.output_text
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # As OpenAI's, a stream cut by max_output_tokens ends with response.incomplete, not response.completed.
    assert [e.type for e in (events[0], events[1], events[-1])] == [
        "response.created", "response.in_progress", "response.incomplete"]
    final = events[-1].response
    assert "".join(deltas) == final.output_text == response.output_text and len(deltas) > 1
    assert final.status == "incomplete" and final.usage.output_tokens == 12


def test_responses_api_parse_returns_the_pydantic_model(client, model):
    parsed = client.responses.parse(model=model, input=QUESTIONS[0], text_format=Weather, temperature=0,
                                    max_output_tokens=100)
    assert isinstance(parsed.output_parsed, Weather) and parsed.status == "completed"


def test_responses_api_function_call_round_trip_whole_and_streamed(client, model):
    tools = [flat_tool(WEATHER_TOOL), flat_tool(TIME_TOOL)]
    kwargs = dict(model=model, input=[{"role": "user", "content": "Time in CET?"}], tools=tools, temperature=0,
                  max_output_tokens=60, tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False)
    first = client.responses.create(**kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"] and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), TIME_TOOL["function"]["parameters"])
    with client.responses.stream(**kwargs) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        streamed = stream.get_final_response()
    streamed_calls = [item for item in streamed.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls] == [
        ("get_time", arguments)]
    # The call and its output go back as items, as the SDK's agent loops send them.
    final = client.responses.create(**{**kwargs, "tool_choice": "none", "max_output_tokens": 20, "input": [
        *kwargs["input"], *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}]})
    assert not [item for item in final.output if item.type == "function_call"] and final.output_text
    assert final.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt


def test_openai_agents_sdk_default_model_runs_a_function_tool_over_the_responses_api(cluster, model):
    """The agents SDK's default model speaks the Responses API (streamed here). The SDK takes a reply cut by
    max_output_tokens for a failure, and the tiny model's free text runs to it, so the tool's result is the answer."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner

    get_weather, cities = agents_weather_tool()

    async def run():
        async with openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            agent = Agent(
                name="weather", instructions="Use the tool.", tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                model=OpenAIResponsesModel(model=model, openai_client=client),
                model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40,
                                             parallel_tool_calls=False, store=False),
            )
            streamed = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            async for _ in streamed.stream_events():
                pass
            return streamed

    result = asyncio.run(run())
    assert cities and cities[0] in ("Paris", "Rome") and result.final_output == f"sunny in {cities[0]}"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"temperature": -1}, "temperature"),
])
def test_responses_api_refuses_what_it_does_not_serve_naming_the_field(cluster, model, body, param):
    response = HTTP.post(cluster.url + "/v1/responses", json={"model": model, "input": "Hi", **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# --- thinking (DeepSeek-R1 / V3.1 format) ----------------------------------------------------------------------------

THINK = {"chat_template_kwargs": {"thinking": True}}


def test_a_thinking_prompt_returns_the_reasoning_apart_whole_and_streamed(client, model):
    """The template opens <think> after the assistant tag; the tiny model never closes it, so all its text is
    reasoning, exactly the raw text a completion of the same prompt gives."""
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Is 2 < 3?"}], temperature=0, max_tokens=10)
    whole = client.chat.completions.create(**kwargs, extra_body={**THINK, "ignore_eos": True, "return_token_ids": True})
    message = whole.choices[0].message
    prompt = whole.choices[0].model_extra["prompt_token_ids"]
    raw = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert message.model_extra["reasoning_content"] == raw and not message.content
    assert whole._request_id == whole.id  # OpenAI's x-request-id header
    assert whole.usage.completion_tokens_details.reasoning_tokens == 10  # never closed: every token is reasoning
    streamed = [chunk.choices[0].delta for chunk in client.chat.completions.create(
        **kwargs, stream=True, extra_body={**THINK, "ignore_eos": True}) if chunk.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in streamed) == raw
    assert not "".join(d.content or "" for d in streamed)
    plain = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].message
    assert plain.content and plain.model_extra.get("reasoning_content") is None  # not asked to think


def test_the_router_counts_reasoning_tokens_in_its_metrics(cluster, client, model):
    def counted() -> float:
        text = HTTP.get(cluster.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve_router_reasoning_tokens_total{"))

    before = counted()
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is 2 < 3?"}], temperature=0,
                                   max_tokens=7, extra_body={**THINK, "ignore_eos": True})
    for _ in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is 2 < 3?"}],
                                            temperature=0, max_tokens=7, stream=True,
                                            extra_body={**THINK, "ignore_eos": True}):
        pass
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert counted() - before == 14  # two thinking answers (whole, streamed) of 7 tokens, all reasoning; none more


def test_a_thinking_prompt_answers_in_json_after_its_reasoning(client, model, tiny_v3_deepseek):
    """The grammar allows free reasoning, then </think>, then the JSON: a bias on </think> ends the reasoning at
    once, and the content is the schema's JSON (a grammar from the first token would have made the reasoning JSON)."""
    end_id = PromptTokenizer(tiny_v3_deepseek).tokenizer.token_to_id("</think>")
    schema = {**Weather.model_json_schema(), "additionalProperties": False}
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}},
        logit_bias={str(end_id): 100}, extra_body=THINK)
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] is None and response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens_details.reasoning_tokens == 1  # </think> alone
    jsonschema.validate(json.loads(message.content), schema)


def test_responses_api_returns_the_reasoning_as_an_item_whole_and_streamed(client, model):
    """Cut by max_output_tokens while reasoning, the output is the reasoning item alone, as OpenAI's is."""
    response = client.responses.create(model=model, input="Is 2 < 3?", temperature=0, max_output_tokens=8,
                                       extra_body={**THINK, "ignore_eos": True})
    assert [item.type for item in response.output] == ["reasoning"] and response.output_text == ""
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is 2 < 3?"}],
                                          temperature=0, max_tokens=8, extra_body={**THINK, "ignore_eos": True})
    assert response.output[0].content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    with client.responses.stream(model=model, input="Is 2 < 3?", temperature=0, max_output_tokens=8,
                                 extra_body={**THINK, "ignore_eos": True}) as stream:  # the SDK's accumulating reader
        events = list(stream)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == response.output[0].content[0].text
    assert [item.type for item in events[-1].response.output] == ["reasoning"]  # the stream's items are the same
    # The reasoning item goes back as input (the agents SDK sends it) and is dropped, as the template drops it.
    again = client.responses.create(model=model, temperature=0, max_output_tokens=8, extra_body={"ignore_eos": True},
                                    input=[{"role": "user", "content": "Is 2 < 3?"},
                                           response.output[0].model_dump(exclude_none=True),
                                           {"role": "user", "content": "Sure?"}])
    assert again.status == "incomplete" and again.output_text


def test_offline_chat_renders_as_the_router_does(client, model, tiny_v3_deepseek):
    """`LLM.chat` renders conversations with the model's template: greedy, it writes what the cluster answers (and
    with `thinking`, the cluster's reasoning)."""
    conversations = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                     [{"role": "user", "content": "Is 2 < 3?"}]]
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_v3_deepseek, progress=False)
    offline = llm.chat(conversations, sampling)
    served = [client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                             extra_body={"ignore_eos": True}).choices[0].message.content
              for messages in conversations]
    assert [result.text for result in offline] == served
    thought = llm.chat(conversations[1], sampling, thinking=True)[0]  # one conversation alone
    answer = client.chat.completions.create(model=model, messages=conversations[1], temperature=0, max_tokens=8,
                                            extra_body={**THINK, "ignore_eos": True}).choices[0].message
    assert thought.text == answer.model_extra["reasoning_content"] and thought.text != offline[1].text
