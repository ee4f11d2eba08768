"""A real uvicorn router on 127.0.0.1 (random port) with zero workers: every bad input gets an OpenAI-shaped 4xx,
a good one a 503 with Retry-After, and /v1/models, /health, /metrics answer."""

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from probes import HTTP

from pdserve_router.app import build_router_app
from pdserve_router.config import RouterConfig

API_KEY = "sk-test-123"
MAX_MODEL_LEN = 64


class RunningRouter:
    def __init__(self, config: RouterConfig) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_router_app(config), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "router did not start within 10 s"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def config_for(model_dir, **overrides) -> RouterConfig:
    settings = {"served_model_name": "tiny", "max_model_len": MAX_MODEL_LEN, "max_body_bytes": 64 * 1024, **overrides}
    return RouterConfig(model_dir=str(model_dir), **settings)


@pytest.fixture(scope="module")
def router(tiny_model_dir):
    with RunningRouter(config_for(tiny_model_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_router(tiny_model_dir):
    with RunningRouter(config_for(tiny_model_dir, api_keys=frozenset({API_KEY, "sk-other"}))) as running:
        yield running


def post(router, path, **kwargs) -> httpx.Response:
    return HTTP.post(router.url + path, timeout=10, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


GOOD_COMPLETION = {"model": "tiny", "prompt": "hello world", "max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**GOOD_COMPLETION, "max_tokens": "four"}, "max_tokens"),
        ({**GOOD_COMPLETION, "max_tokens": 0}, "max_tokens"),
        ({**GOOD_COMPLETION, "temperature": -0.5}, "temperature"),
        ({**GOOD_COMPLETION, "top_p": 1.5}, "top_p"),
        ({**GOOD_COMPLETION, "n": 0}, "n"),
        ({**GOOD_COMPLETION, "n": 1000}, "n"),
        ({**GOOD_COMPLETION, "stream": "yes"}, "stream"),
        ({**GOOD_COMPLETION, "stop": [1, 2]}, "stop[0]"),
        ({**GOOD_COMPLETION, "seed": 10**30}, "seed"),
        ({**GOOD_COMPLETION, "prompt": [1, "two"]}, "prompt"),
        ({**GOOD_COMPLETION, "prompt": []}, "prompt"),
        ({"prompt": "hi"}, "model"),
        ({**GOOD_COMPLETION, "max_tokens": 100_000}, "max_tokens"),
        ({**GOOD_COMPLETION, "prompt": "hello " * 100}, "prompt"),
        ({**GOOD_COMPLETION, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ],
)
def test_bad_completion_fields_give_400_naming_the_field(router, body, param):
    assert_openai_error(post(router, "/v1/completions", json=body), 400, param)


def test_prompt_longer_than_context_says_so(router):
    error = assert_openai_error(post(router, "/v1/completions", json={**GOOD_COMPLETION, "prompt": list(range(1, 200))}), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": "no"}, "logprobs"),
    ],
)
def test_bad_chat_fields_give_400_naming_the_field(router, body, param):
    assert_openai_error(post(router, "/v1/chat/completions", json=body), 400, param)


def test_malformed_json_gives_400(router):
    error = assert_openai_error(post(router, "/v1/completions", content=b'{"model": "tiny", "prompt": '), 400)
    assert error["code"] == "invalid_json"


def test_invalid_utf8_and_deep_nesting_give_400_not_500(router):
    assert_openai_error(post(router, "/v1/completions", content=b'{"model": "\xff\xfe", "prompt": "x"}'), 400)
    assert_openai_error(post(router, "/v1/completions", content=b'{"model":"tiny","prompt":' + b"[" * 5000 + b"]" * 5000 + b"}"), 400)


def test_oversized_body_gives_413(router):
    assert_openai_error(post(router, "/v1/completions", json={**GOOD_COMPLETION, "prompt": "x" * 100_000}), 413)


def test_unknown_model_gives_404(router):
    error = assert_openai_error(post(router, "/v1/completions", json={**GOOD_COMPLETION, "model": "gpt-9"}), 404, "model")
    assert error["code"] == "model_not_found"


def test_unknown_fields_and_nulls_are_accepted_and_reach_the_no_worker_503(router):
    body = {**GOOD_COMPLETION, "stop": None, "seed": None, "logit_bias": {"1": 2}, "user": "u", "stream_options": None}
    response = post(router, "/v1/completions", json=body)
    assert_openai_error(response, 503)
    assert response.headers["retry-after"] == "1"


def test_unknown_route_gives_openai_shaped_404(router):
    assert_openai_error(HTTP.get(router.url + "/v1/nothing", timeout=10), 404)


def test_models_health_and_metrics_answer(router):
    models = HTTP.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert HTTP.get(router.url + "/health", timeout=10).json() == {"status": "ok", "workers": {}}
    assert_openai_error(post(router, "/v1/completions", json={**GOOD_COMPLETION, "model": "gpt-9"}), 404)  # counted
    metrics = HTTP.get(router.url + "/metrics", timeout=10).text
    assert "pdserve_requests_total" in metrics and 'status="rejected"' in metrics


def test_openapi_schema_describes_the_request_bodies(router):
    document = HTTP.get(router.url + "/openapi.json", timeout=10).json()
    assert "CompletionRequest" in document["components"]["schemas"]
    assert "max_tokens" in document["components"]["schemas"]["CompletionRequest"]["properties"]


def test_missing_or_wrong_api_key_gives_401_and_right_key_passes(keyed_router):
    assert_openai_error(post(keyed_router, "/v1/completions", json=GOOD_COMPLETION), 401)
    assert_openai_error(post(keyed_router, "/v1/completions", json=GOOD_COMPLETION, headers={"Authorization": "Bearer sk-wrong"}), 401)
    assert_openai_error(HTTP.get(keyed_router.url + "/v1/models", timeout=10), 401)
    ok = HTTP.get(keyed_router.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert ok.status_code == 200
    assert HTTP.get(keyed_router.url + "/health", timeout=10).status_code == 200  # probes need no key


def test_openai_sdk_sees_typed_errors(keyed_router):
    client = openai.OpenAI(base_url=keyed_router.url + "/v1", api_key=API_KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_p=3.0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_router.url + "/v1", api_key="sk-bad", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["tiny"]
