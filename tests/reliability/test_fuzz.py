"""API fuzzing against a live cluster: random requests built from the router's OpenAPI schema (its field names,
random JSON values), raw malformed bodies, and random JSON to a worker's internal API. No answer may be a 5xx
(a 503 with Retry-After for "no worker" excepted: none happens here), and the cluster serves normally afterwards.
Example counts are bounded so the file runs in well under a minute after the cluster is up."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from probes import HTTP, eventually, internal_headers
from stream_calls import model_of, pages_at_rest, stream_completion

READ_TIMEOUT_S = 3.0  # a valid request may generate for long; its status is all we read
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False), st.text(max_size=20),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)


def status_of(url: str, content: bytes, headers: dict | None = None) -> int:
    """POST and return the status; a request still generating when the read timeout hits counts as accepted (the
    router aborts it when we leave)."""
    try:
        with HTTP.stream("POST", url, content=content, timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S),
                          headers=headers or {"content-type": "application/json"}) as response:
            return response.status_code
    except httpx.ReadTimeout:
        return 200


def schema_fields(cluster, name: str) -> dict:
    document = HTTP.get(cluster.url + "/openapi.json", timeout=10).json()
    return document["components"]["schemas"][name]["properties"]


def request_bodies(fields: list[str], model: str):
    """Objects with the schema's field names: mostly sensible values, some random JSON of any type."""
    sensible = {
        "model": st.sampled_from([model, "other-model", ""]),
        "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 2**40), max_size=8)),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                    "content": st.text(max_size=30)}), max_size=3),
        "max_tokens": st.integers(-3, 2**66), "n": st.integers(-2, 40), "temperature": st.floats(-2, 1e9),
        "stream": st.booleans(),
    }
    value_of = {f: st.one_of(sensible.get(f, json_values), json_values) if f in sensible else json_values
                for f in fields}
    return st.fixed_dictionaries({"model": value_of.get("model", json_values)},
                                 optional={f: s for f, s in value_of.items() if f != "model"})


@pytest.fixture(scope="module")
def model(pd_cluster) -> str:
    return model_of(pd_cluster.url)


@pytest.mark.parametrize(("schema", "path"), [("CompletionRequest", "/v1/completions"),
                                              ("ChatCompletionRequest", "/v1/chat/completions")])
def test_schema_shaped_random_requests_never_get_a_5xx(pd_cluster, model, schema, path):
    fields = list(schema_fields(pd_cluster, schema))

    @FUZZ
    @given(request_bodies(fields, model))
    def check(body):
        assert status_of(pd_cluster.url + path, json.dumps(body).encode()) < 500, body

    check()


def malformed_bodies(model: str) -> list[bytes]:
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        b"", b"{", b"null", b"[]", b"123", b'"text"', b"{'single': 'quotes'}", b"\xff\xfe\xfd", b'{"model": "\xc3\x28"}',
        json.dumps({"model": model, "prompt": "hi", "max_tokens": 10**400}).encode(),
        json.dumps({"model": model, "prompt": "hi", "max_tokens": 1e308}).encode(),
        json.dumps({"model": model, "prompt": [10**30], "max_tokens": 2}).encode(),
        json.dumps({"model": model, "prompt": [-1, 2**63], "max_tokens": 2}).encode(),
        json.dumps({"model": model, "prompt": [10**6], "max_tokens": 2}).encode(),  # outside the vocabulary
        json.dumps({"model": model, "prompt": [-1], "max_tokens": 2}).encode(),
        json.dumps({"model": model, "prompt": "hi", "n": 10**9}).encode(),
        json.dumps({"model": model, "prompt": "hi", "stop": ["a"] * 10_000}).encode(),
        json.dumps({"model": model, "prompt": {"nested": [[[[[]]]]]}}).encode(),
        b'{"model": "' + model.encode() + b'", "prompt": ' + deep + b"}",
        b'{"model": "' + model.encode() + b'", "prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}',
        json.dumps({"model": model, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
    ]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bodies_never_get_a_5xx(pd_cluster, model, path):
    for body in malformed_bodies(model):
        assert status_of(pd_cluster.url + path, body) < 500, body[:100]
    assert status_of(pd_cluster.url + path, b'{"a": 1}', headers={"content-type": "text/plain"}) < 500


def test_a_prompt_token_id_outside_the_vocabulary_is_a_400_naming_the_prompt(pd_cluster, model):
    response = HTTP.post(pd_cluster.url + "/v1/completions", json={"model": model, "prompt": [5, 10**6]}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_random_json_to_the_worker_internal_api_never_gets_a_5xx(pd_cluster):
    worker = next(w for w in pd_cluster.workers if w.name.startswith("both"))
    sampling = st.fixed_dictionaries({}, optional={
        "max_tokens": st.one_of(st.integers(-2, 2**65), json_values), "temperature": st.one_of(st.floats(-1, 5), json_values),
        "top_k": st.integers(-3, 10**6), "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), json_values)})
    generate = st.fixed_dictionaries(
        {"request_id": st.one_of(st.text(max_size=10), json_values), "rank": st.one_of(st.integers(-2, 2**64), json_values),
         "prompt_token_ids": st.one_of(st.lists(st.integers(-(2**65), 2**65), max_size=6), json_values)},
        optional={"sampling": st.one_of(sampling, json_values), "plan": st.one_of(
            st.fixed_dictionaries({"kind": st.sampled_from(["both", "prefill", "decode", "x"])}), json_values),
            "api_version": st.one_of(st.just(1), json_values)})

    @FUZZ
    @given(st.one_of(generate, json_values))
    def check(body):
        headers = {"content-type": "application/json", **internal_headers()}
        assert status_of(worker.url + "/internal/v1/generate", json.dumps(body).encode(), headers) < 500, body
        assert status_of(worker.url + "/internal/v1/abort", json.dumps(body).encode(), headers) < 500, body

    check()
    for prompt in ([10**6], [-1], [2**62]):  # outside the vocabulary: refused, and the rank survives
        body = {"request_id": "oov", "rank": 0, "prompt_token_ids": prompt, "sampling": {"max_tokens": 2}}
        response = HTTP.post(worker.url + "/internal/v1/generate", json=body, headers=internal_headers(), timeout=30)
        assert response.status_code < 500 and "error" in response.text
    for query in ("rank=0&after=abc", "rank=99", "rank=-1", f"rank={2**70}", "rank=0&after=" + "9" * 40):
        for path in ("/internal/v1/transfer/metadata", "/internal/v1/kv_events"):
            try:
                with HTTP.stream("GET", f"{worker.url}{path}?{query}", headers=internal_headers(),
                                  timeout=httpx.Timeout(10, read=2)) as response:
                    assert response.status_code < 500, (path, query)
            except httpx.ReadTimeout:
                pass  # a live KV-event stream


def test_the_cluster_serves_normally_after_the_fuzzing(pd_cluster, model):
    result = stream_completion(pd_cluster.url, model, "after the fuzz", 8)
    assert not result.errors and result.finish_reason == "length" and len(result.token_ids) == 8
    for worker in pd_cluster.workers:
        assert HTTP.get(worker.url + "/health", timeout=10).status_code == 200
        assert eventually(lambda w=worker: pages_at_rest(w.url), timeout_s=30)
