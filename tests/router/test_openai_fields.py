"""Every OpenAI field the router used to drop now works or is a 400 naming it, decided before any worker is asked
(a real router on 127.0.0.1 with no workers: a request that passes every check gets the no-worker 503). Also
/v1/models/{id}, /tokenize and /detokenize, and the OpenAPI schema's 4xx per route."""

import httpx
import pytest
from probes import HTTP

from pdserve.text.generation_defaults import GenerationDefaults
from pdserve_router import openai_schema as schema
from tests.router.test_app import RunningRouter, assert_openai_error, config_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TOOL_CALL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny and 21 C"},
]


@pytest.fixture(scope="module")
def router(tiny_v3_deepseek):
    with RunningRouter(config_for(tiny_v3_deepseek, max_prompt_chars=2000, max_model_len=4096)) as running:
        yield running


def post(router, path, body) -> httpx.Response:
    return HTTP.post(router.url + path, json=body, timeout=30)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, "logit_bias[...]"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "store": True}, "store"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 5}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_unimplemented_or_bad_openai_fields_are_a_400_naming_them(router, path, body, param):
    assert_openai_error(post(router, path, body), 400, param)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {**COMPLETION, "echo": True, "best_of": 1, "presence_penalty": 1.5, "frequency_penalty": -1,
                         "logit_bias": {"5": -100}, "user": "u", "repetition_penalty": 1.2}),
    ("/v1/completions", {**COMPLETION, "logprobs": 5}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20, "modalities": ["text"], "store": False,
                              "metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": False,
                              "tools": [TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "none"}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                "required": ["a"], "additionalProperties": False}}}}),
    ("/v1/chat/completions", {**CHAT, "messages": TOOL_CALL_HISTORY, "tools": [TOOL]}),
])
def test_implemented_fields_pass_every_check(router, path, body):
    assert_openai_error(post(router, path, body), 503)  # no workers: everything before routing was accepted


def test_an_over_bound_prompt_is_refused_before_any_tokenization_starts(router):
    text_workers = router.server.config.app.state.parts.serving._text
    before = text_workers.jobs_started
    error = assert_openai_error(post(router, "/v1/completions", {**COMPLETION, "prompt": "x" * 2001}), 400, "prompt")
    assert error["code"] == "prompt_too_long"
    assert_openai_error(post(router, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * 2001}]}),
                        400, "messages")
    assert text_workers.jobs_started == before
    assert_openai_error(post(router, "/v1/completions", {**COMPLETION, "prompt": "x" * 1999}), 503)
    assert text_workers.jobs_started == before + 1


def test_tool_calls_and_tool_results_are_kept_in_the_rendered_history(router):
    body = post(router, "/tokenize", {"model": "tiny", "messages": TOOL_CALL_HISTORY, "return_token_strs": True}).json()
    text = HTTP.post(router.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()["prompt"]
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather" in text and '{"city":"Paris"}' in text
    assert "<｜tool▁output▁begin｜>sunny and 21 C<｜tool▁output▁end｜>" in text
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 4096
    assert "<｜tool▁calls▁begin｜>" in body["token_strs"]  # one added token, not spelled out


def test_tools_are_rendered_into_the_prompt(router):
    with_tools = post(router, "/tokenize", {"messages": CHAT["messages"], "tools": [TOOL]}).json()["tokens"]
    without = post(router, "/tokenize", {"messages": CHAT["messages"]}).json()["tokens"]
    text = HTTP.post(router.url + "/detokenize", json={"tokens": with_tools}, timeout=30).json()["prompt"]
    assert len(with_tools) > len(without) and '"name": "get_weather"' in text


def test_tokenize_and_detokenize_round_trip_text(router):
    body = post(router, "/tokenize", {"model": "tiny", "prompt": "Hello, world!", "add_special_tokens": False}).json()
    assert body["count"] == len(body["tokens"]) > 1
    assert post(router, "/detokenize", {"model": "tiny", "tokens": body["tokens"]}).json() == {"prompt": "Hello, world!"}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "messages": CHAT["messages"]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"prompt": "z" * 2001}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenize_and_detokenize_errors(router, path, body, status, param):
    assert_openai_error(post(router, path, body), status, param)


def test_model_by_id(router):
    assert HTTP.get(router.url + "/v1/models/tiny", timeout=10).json()["id"] == "tiny"
    error = assert_openai_error(HTTP.get(router.url + "/v1/models/gpt-9", timeout=10), 404, "model")
    assert error["code"] == "model_not_found"


def test_openapi_documents_every_4xx_of_each_route(router):
    paths = HTTP.get(router.url + "/openapi.json", timeout=10).json()["paths"]
    expected = {("/v1/chat/completions", "post"): {"400", "401", "404", "408", "413", "429"},
                ("/v1/completions", "post"): {"400", "401", "404", "408", "413", "429"},
                ("/tokenize", "post"): {"400", "401", "404", "408", "413"},
                ("/detokenize", "post"): {"400", "401", "404", "408", "413"},
                ("/v1/models/{model_id}", "get"): {"401", "404"}, ("/v1/models", "get"): {"401"}}
    for (path, method), statuses in expected.items():
        responses = paths[path][method]["responses"]
        assert {s for s in responses if s.startswith("4")} == statuses, path
        assert responses["400" if "400" in statuses else "401"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}


def test_generation_config_defaults_fill_what_the_request_leaves_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 7, "repetition_penalty": 1.1}')
    defaults = GenerationDefaults.from_model_dir(tmp_path)
    request = schema.decode_request(b'{"model": "m", "prompt": "x"}', schema.CompletionRequest)
    sampling = schema.sampling_params_of(request, schema.resolve_max_tokens(request, 3, 100, 1000, defaults.max_tokens),
                                         0, defaults, {}, None)
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.repetition_penalty) == (0.6, 0.95, 7, 1.1)
    explicit = schema.decode_request(b'{"model": "m", "prompt": "x", "temperature": 0, "top_p": 0.5, "max_tokens": 3}',
                                     schema.CompletionRequest)
    sampling = schema.sampling_params_of(explicit, schema.resolve_max_tokens(explicit, 3, 100, 1000, 7), 0, defaults, {}, None)
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.0, 0.5, 3)
    (tmp_path / "generation_config.json").write_text('{"do_sample": false}')
    assert GenerationDefaults.from_model_dir(tmp_path).temperature == 0.0
