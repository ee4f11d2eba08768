"""The OpenAI SDK against a real router with real prefill, decode and colocated workers."""

import concurrent.futures
import time

import openai
import pytest
import torch
from probes import eventually, metric_total

from pdserve import LLM, SamplingParams
from pdserve.cluster.local import ClusterConfig, LocalCluster


def sdk_for(cluster) -> tuple[openai.OpenAI, str]:
    sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    return sdk, sdk.models.list().data[0].id


@pytest.fixture(scope="module")
def client(pd_cluster):
    return sdk_for(pd_cluster)[0]


@pytest.fixture(scope="module")
def MODEL(pd_cluster):
    return sdk_for(pd_cluster)[1]


def test_token_id_prompts_give_the_offline_engine_tokens(client, MODEL, tiny_v2):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (5, 33, 90)]
    expected = LLM(tiny_v2, progress=False, dtype="float32").generate(
        prompt_token_ids=prompts, sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, want in zip(prompts * 2, [r.token_ids for r in expected] * 2):  # twice: prefix hits the second time
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        assert response.choices[0].model_extra["token_ids"] == want
        assert response.usage.completion_tokens == 12 and response.usage.prompt_tokens == len(prompt)


def test_streaming_completion_equals_non_streaming(client, MODEL):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_streaming_and_not(client, MODEL):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 8
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content


def test_cached_prompt_tokens_are_reported(client, MODEL):
    prompt = "A long shared system prompt about foxes and dogs. " * 6
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


# slow: ~20 s alone and 55-67 s in CI beside the other pytest process; worker death mid-stream is also covered by
# tests/reliability/test_stream_migration.py and tests/worker/test_disaggregation_faults.py. `pytest -m slow` runs it.
@pytest.mark.slow
def test_killing_a_worker_mid_run_loses_no_request_and_is_reported(tiny_v2, ray_address, tmp_path):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=0, num_decode=0, num_both=2, ray_address=ray_address,
                        worker_args=("--dtype", "float32"), log_dir=str(tmp_path))
    with LocalCluster(cfg) as cluster:
        sdk, model = sdk_for(cluster)

        def one(i: int) -> str:
            try:
                sdk.completions.create(model=model, prompt=f"request {i} about a fox", max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True})
                return "ok"
            except openai.APIError as error:
                return f"error: {error}"

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(24)]
            time.sleep(2.0)
            cluster.kill(cluster.workers[0])
            outcomes = [f.result(timeout=120) for f in futures]
        assert time.monotonic() - started < 120  # nothing hung
        assert outcomes.count("ok") >= 12, outcomes  # the survivor served the rest
        assert all(o == "ok" or o.startswith("error") for o in outcomes)
        after = [one(100 + i) for i in range(4)]
        assert after == ["ok"] * 4  # new requests go to the survivor only
        # Health checks eject a dead worker within seconds.
        assert eventually(lambda: metric_total(cluster.url, "pdserve_router_worker_ejections_total") >= 1, 15,
                          interval_s=0.25)


def routed_match_sum(cluster) -> float:
    return metric_total(cluster.url, "pdserve_routed_prefix_match_ratio_sum")


def test_restarted_router_rebuilds_its_prefix_index_from_the_workers(pd_cluster, client, MODEL):
    prompt = "Router restart check: a prompt long enough to fill several pages of the KV cache. " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    pd_cluster.restart_router()
    assert routed_match_sum(pd_cluster) == 0  # a fresh router: nothing routed, nothing remembered
    time.sleep(5)  # its subscriptions fetch each rank's full KV-event dump
    sdk = openai.OpenAI(base_url=pd_cluster.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert routed_match_sum(pd_cluster) > 0.5  # its first request already matched most of the prompt
