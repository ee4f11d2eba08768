"""The router's count of KV events (pdserve_router_kv_events_total) against real workers: every prefill rank's
full dump at subscription, then the pages a prefill caches, reach the router's prefix index and are counted."""

from probes import HTTP, eventually
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 60.0


def kv_events_by_kind(router_url: str) -> dict[str, float]:
    text = HTTP.get(router_url + "/metrics", timeout=10).text
    return {sample.labels["kind"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "pdserve_router_kv_events_total"}


def kv_events(router_url: str, kind: str) -> float:
    return kv_events_by_kind(router_url)[kind]


def test_a_prefilled_prompt_s_kv_events_are_counted_by_the_router(pd_cluster):
    prefill_ranks = sum(w.name.startswith(("prefill", "both")) for w in pd_cluster.workers)
    assert prefill_ranks == 2
    assert set(kv_events_by_kind(pd_cluster.url)) == {"stored", "removed", "cleared"}  # every kind from the start
    # Each subscription starts with a full dump, which begins with a `cleared` event.
    assert eventually(lambda: kv_events(pd_cluster.url, "cleared") >= prefill_ranks, TIMEOUT_S)
    stored_before = kv_events(pd_cluster.url, "stored")
    model = HTTP.get(pd_cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    prompt = [5 + (i * 37) % 390 for i in range(150)]  # tokens no other test sends: pages new to every rank
    response = HTTP.post(pd_cluster.url + "/v1/completions", timeout=TIMEOUT_S,
                          json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert eventually(lambda: kv_events(pd_cluster.url, "stored") > stored_before, 10.0)
