"""Disaggregation changes where a request runs, not what it answers: the same requests to a P/D pair (1 prefill + 1
decode) and to a colocated worker give the same responses, field for field (ids and timestamps aside), streamed and
not. The router may send one request either way (conditional disaggregation, the prefill fallback), so a seeded
request must draw the same tokens on both paths. Streams are compared by what they carry, not how it is chunked."""

import json

import pytest
import torch
from probes import HTTP
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from tests.engine.test_cuda_graphs import FLASHINFER_SHAPE

TIMEOUT_S = 60.0
PROMPT = list(range(5, 45))
MESSAGES = [{"role": "user", "content": "hello there, tell me something"}]
# name -> (endpoint, body); each non-greedy one is seeded.
CASES = {
    "greedy": ("completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
    "logprobs": ("completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}),
    "seeded": ("completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}),
    "seeded top-p top-k": ("completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "top_p": 0.9,
                                           "top_k": 20, "seed": 3}),
    "seeded n=2": ("completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11, "n": 2}),
    "penalties": ("completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "presence_penalty": 1.5,
                                  "frequency_penalty": 1.0, "repetition_penalty": 1.3}),
    "max_tokens 1": ("completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}),
    "min_tokens": ("completions", {"prompt": PROMPT, "max_tokens": 10, "min_tokens": 10, "temperature": 0}),
    "logit_bias to a lone byte": ("completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                  "logit_bias": {"118": 100}}),
    "chat logprobs": ("chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True,
                                           "top_logprobs": 2}),
    "chat json_object": ("chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                              "response_format": {"type": "json_object"}}),
    "chat json_schema seeded": ("chat/completions", {
        "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, "seed": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "pick", "schema": {
                "type": "object", "properties": {"n": {"type": "integer"}, "word": {"type": "string"}},
                "required": ["n", "word"]}}}}),
    "chat seeded": ("chat/completions", {"messages": MESSAGES, "max_tokens": 10, "temperature": 1.0, "seed": 5}),
}


def without_ids(value):
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def stream_content(chunks: list[dict]) -> dict:
    """Per choice: the text and log-probabilities in order, and the finish reason; the usage chunk."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            seen = choices.setdefault(choice["index"], {"text": "", "logprobs": [], "finish_reason": None})
            seen["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            logprobs = choice.get("logprobs") or {}
            seen["logprobs"] += logprobs.get("content") or logprobs.get("token_logprobs") or []
            seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]
    return {"choices": choices, "usage": usage}


def answers(cfg: ClusterConfig) -> dict[str, tuple]:
    with InProcessCluster(cfg) as cluster:
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        greedy = HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
        cases = CASES | {  # stop strings from the greedy text: one that the first token hits, one later
            "stop at the first token": ("completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                        "stop": [greedy[:1]]}),
            "stop later": ("completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                           "stop": [greedy[3:5]]}),
        }
        found = {}
        for name, (endpoint, body) in cases.items():
            url = f"{cluster.url}/v1/{endpoint}"
            whole = HTTP.post(url, timeout=TIMEOUT_S, json=body | {"model": model})
            streamed = HTTP.post(url, timeout=TIMEOUT_S, json=body | {
                "model": model, "stream": True, "stream_options": {"include_usage": True}})
            chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            found[name] = (whole.status_code, without_ids(whole.json()), streamed.status_code, stream_content(chunks))
        for worker in cluster.workers:  # every rank of every worker took part
            text = HTTP.get(worker.url + "/metrics", timeout=TIMEOUT_S).text
            counted = {sample.labels["rank"]: sample.value for family in text_string_to_metric_families(text)
                       for sample in family.samples if sample.name == "pdserve_generation_tokens_total"}
            assert len(counted) == cfg.ranks_per_worker and all(counted.values()), (worker.name, counted)
        return found


# On the CPU in float32. On a GPU in bf16, both workers on GPU 0 with small pools, KV over NIXL from GPU memory: the
# tiny model's narrow attention on the torch reference, eagerly (`pdserve up` on a GPU machine), and a model of
# flashinfer's widths as served (flashinfer, CUDA graphs, overlapped steps).
ON_CPU, ON_GPU = ("--dtype", "float32"), ("--num-pages", "512")
ON_GPU_CASES = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=[
    pytest.param((ON_CPU, 1, {}), id="1 rank"), pytest.param((ON_CPU, 2, {}), id="2 ranks"),
    pytest.param((ON_GPU, 1, {}), id="gpu eager", marks=ON_GPU_CASES),
    pytest.param((ON_GPU, 1, FLASHINFER_SHAPE), id="gpu flashinfer", marks=ON_GPU_CASES)])
def both_ways(tiny_model_factory, request) -> tuple[dict, dict]:
    """Workers of one rank, and of two (round robin: requests take turns on the ranks, hand-offs from and to rank 1
    too)."""
    worker_args, ranks, shape = request.param
    model = tiny_model_factory("v2", **shape)
    disaggregated = answers(ClusterConfig(model=model, port=0, num_prefill=1, num_decode=1, ranks_per_worker=ranks,
                                          routing="round_robin", worker_args=worker_args))
    colocated = answers(ClusterConfig(model=model, port=0, num_prefill=0, num_decode=0, num_both=1,
                                      ranks_per_worker=ranks, routing="round_robin", worker_args=worker_args))
    return disaggregated, colocated


@pytest.mark.parametrize("case", [*CASES, "stop at the first token", "stop later"])
def test_a_disaggregated_answer_equals_the_colocated_one(both_ways, case):
    disaggregated, colocated = both_ways
    assert disaggregated[case][0] == disaggregated[case][2] == 200, disaggregated[case]
    assert disaggregated[case] == colocated[case]
