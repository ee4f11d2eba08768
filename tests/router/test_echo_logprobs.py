"""Completions with `echo` and `logprobs` (how lm-evaluation-harness scores multiple-choice tasks): the prompt's
tokens come back with their log-probabilities before the output's, through a real router and prefill/decode or
colocated workers, equal to the offline engine's and to transformers' own, whole and streamed, also for a prompt
the prefix cache already holds (whose cached pages have no logits: it is computed whole)."""

import json

import pytest
import torch
from probes import HTTP

from pdserve import LLM, SamplingParams
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

TIMEOUT_S = 60.0
MAX_TOKENS_LIMIT = 64  # so at most 64 x 21 prompt log-probability entries a prompt
DEPLOYMENTS = {"pd": dict(num_prefill=1, num_decode=1), "colocated": dict(num_prefill=0, num_decode=0, num_both=1)}


@pytest.fixture(scope="module", params=sorted(DEPLOYMENTS))
def cluster(request, tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, worker_args=("--dtype", "float32"),
                        router_args=("--max-tokens-limit", str(MAX_TOKENS_LIMIT)), **DEPLOYMENTS[request.param])
    with InProcessCluster(cfg) as running:
        yield running


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(8)
    return [torch.randint(2, 400, (n,), generator=gen).tolist() for n in (40, 23)]


@pytest.fixture(scope="module")
def offline(tiny_v2, prompts):
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2,
                              prompt_logprobs=2)
    engine = LLM(tiny_v2, progress=False, dtype="float32").engine
    firsts = {}
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, sampling)
    while engine.has_work():
        for output in engine.step():
            firsts.setdefault(output.request_id, output)
    return [firsts[str(i)] for i in range(len(prompts))]


def complete(cluster, prompt, stream=False, **fields):
    model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 2, "stream": stream, **fields}
    response = HTTP.post(cluster.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_echoed_prompt_tokens_have_the_engines_log_probabilities(cluster, prompts, offline, tiny_v2):
    import transformers

    body = complete(cluster, prompts)  # two prompts in one request, as lm-eval batches them
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_v2, dtype=torch.float32)
    for choice, prompt, first in zip(body["choices"], prompts, offline):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + 2
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = [p.logprob for p in first.prompt_logprobs[1:]]
        assert logprobs["token_logprobs"][1:len(prompt)] == pytest.approx(expected, abs=1e-5)
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert expected == pytest.approx([reference[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)],
                                         abs=1e-4)
        # two alternatives each (fewer where two token ids decode to one string: the dict is keyed by text)
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"][1:])
        assert sum(len(top) == 2 for top in logprobs["top_logprobs"][1:]) > len(prompt) // 2
        # the output's part is what a request without echo gets
        assert logprobs["token_logprobs"][len(prompt):] == pytest.approx(
            complete(cluster, prompt, echo=False)["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
        assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_a_cached_prompt_is_computed_whole_for_its_log_probabilities(cluster, prompts):
    complete(cluster, prompts[0], echo=False)  # now in the prefix cache
    again = complete(cluster, prompts[0])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert None not in again["choices"][0]["logprobs"]["token_logprobs"][1:]


def test_streamed_echo_logprobs_equal_the_whole_ones(cluster, prompts):
    whole = complete(cluster, prompts[1])["choices"][0]["logprobs"]
    chunks = complete(cluster, prompts[1], stream=True)
    streamed = {key: [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                      for x in c["choices"][0]["logprobs"][key]] for key in whole}
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"] == whole["text_offset"]
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(whole["token_logprobs"][1:], abs=1e-5)


def test_the_lm_eval_loglikelihood_request_scores_a_continuation(cluster, prompts):
    """lm-eval's `local-completions` loglikelihood request: token ids, echo, max_tokens 1, logprobs 1; it sums the
    continuation's token_logprobs and checks each is the top alternative."""
    context, continuation = prompts[0][:30], prompts[0][30:]
    body = complete(cluster, [context + continuation], max_tokens=1, logprobs=1)
    logprobs = body["choices"][0]["logprobs"]
    scored = logprobs["token_logprobs"][len(context):-1]
    assert len(scored) == len(continuation) and all(isinstance(x, float) and x <= 0 for x in scored)
    tops = logprobs["top_logprobs"][len(context):-1]
    assert all(len(top) == 1 and max(top.values()) >= x - 1e-6 for top, x in zip(tops, scored))


def test_more_prompt_log_probabilities_than_an_output_may_carry_is_a_400(cluster):
    complete(cluster, list(range(2, 66)), logprobs=20)  # 64 x (1 + 20): the most
    model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    response = HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": model, "prompt": list(range(2, 67)), "max_tokens": 1, "echo": True, "logprobs": 20})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logprobs" and "65 tokens asks for 1365 log-probabilities; at most 1344" in error["message"]


def test_vllms_prompt_logprobs_field_on_completions_and_chat(cluster, prompts):
    """vLLM's extension: `prompt_logprobs: N` puts, per prompt token, its id and N alternatives with log-probability,
    rank and text on each completion choice, and once on a chat response; the values are the echo's."""
    echoed = complete(cluster, prompts[0])["choices"][0]["logprobs"]
    choice = complete(cluster, prompts[0], echo=False, logprobs=None, prompt_logprobs=3)["choices"][0]
    assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
    assert len(choice["prompt_logprobs"]) == len(prompts[0])
    for position, entries in enumerate(choice["prompt_logprobs"][1:], start=1):
        token = entries[str(prompts[0][position])]
        assert token["logprob"] == pytest.approx(echoed["token_logprobs"][position], abs=1e-5)
        others = [entry for key, entry in entries.items() if key != str(prompts[0][position])]
        ranks = sorted(entry["rank"] for entry in entries.values())
        assert token["rank"] >= 1 and len(entries) in (3, 4) and ranks[0] == 1
        # the token is among the three most likely exactly when its rank says so, and ranks follow the values
        assert (len(entries) == 3) == (token["rank"] <= 3)
        assert all(other["logprob"] >= token["logprob"] - 1e-6 for other in others if other["rank"] < token["rank"])
    model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    chat = HTTP.post(cluster.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
        "prompt_logprobs": 1}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(1 <= len(entries) <= 2 for entries in chat["prompt_logprobs"][1:])
    refused = HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": model, "prompt": prompts[0], "max_tokens": 1, "stream": True, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
