"""Abuse of the hand-off between real workers, by a caller that can reach the internal API (as if it held the
internal credential): a forged plan naming an unknown worker is refused with 403 before anything is fetched or
computed; one with a made-up reservation token may start its prefill while the reservation is asked for (the prefill
computes while the confirm travels), but is still refused with 403, writes nothing, and its prefill pages all come
back; no endpoint hands out a pool's memory keys. (The pool bytes themselves are checked in process by
tests/disagg/test_handoff.py::test_a_forged_prefill_plan_is_refused_and_writes_nothing.)"""

import httpx
import pytest
from probes import HTTP, Listener, eventually, internal_headers, metric_total
from worker_calls import disaggregated, pages_at_rest, token_ids

from pdserve import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 40))


def worker(cluster, role: str):
    return next(w for w in cluster.workers if w.name.startswith(role))


@pytest.fixture
def listener():
    made = Listener()
    yield made
    made.close()


def post_generate(url: str, plan: dict, request_id: str = "forged") -> httpx.Response:
    body = {"request_id": request_id, "rank": 0, "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 1}, "plan": plan}
    return HTTP.post(url + "/internal/v1/generate", json=body, headers=internal_headers(), timeout=30)


def test_a_prefill_plan_naming_an_unknown_destination_is_refused_without_fetching_it(pd_cluster, listener):
    prefill = worker(pd_cluster, "prefill").url
    response = post_generate(prefill, {"kind": "prefill", "destination": {
        "url": listener.url, "rank": 0, "reservation_token": "x"}})
    assert response.status_code == 403 and "not among this worker's peers" in response.text
    assert listener.connections == 0


def test_a_prefill_plan_with_a_made_up_token_is_refused_and_writes_nothing(pd_cluster):
    prefill, decode = worker(pd_cluster, "prefill").url, worker(pd_cluster, "decode").url
    expected = token_ids(disaggregated(decode, prefill, PROMPT, GREEDY))
    refused = metric_total(decode, "pdserve_kv_reservations_refused_total")
    written = metric_total(prefill, "pdserve_kv_transfer_bytes_total")
    for token in ("made-up", "", "A" * 43):
        response = post_generate(prefill, {"kind": "prefill", "destination": {
            "url": decode, "rank": 0, "reservation_token": token}})
        assert response.status_code == 403, response.text
    assert metric_total(decode, "pdserve_kv_reservations_refused_total") == refused + 3
    assert eventually(lambda: pages_at_rest(prefill), timeout_s=15)  # what the refused prefills computed is freed
    assert metric_total(prefill, "pdserve_kv_transfer_bytes_total") == written
    assert token_ids(disaggregated(decode, prefill, PROMPT, GREEDY)) == expected


def test_a_prefill_plan_in_the_old_form_with_pages_and_deadline_is_a_bad_request(pd_cluster):
    prefill, decode = worker(pd_cluster, "prefill").url, worker(pd_cluster, "decode").url
    response = post_generate(prefill, {"kind": "prefill", "destination": {
        "url": decode, "rank": 0, "agent_name": "decode-r0", "page_ids": [0, 1, 2], "write_deadline_unix_s": 0}})
    assert response.status_code == 400 and "reservation_token" in response.text


def test_a_decode_plan_naming_an_unknown_prefill_worker_is_refused_without_calling_it(pd_cluster, listener):
    decode = worker(pd_cluster, "decode").url
    response = post_generate(decode, {"kind": "decode", "prefill": {"url": listener.url, "rank": 0}})
    assert response.status_code == 403
    assert listener.connections == 0


def test_no_endpoint_hands_out_a_pools_memory_keys_without_a_reservation_token(pd_cluster):
    decode = worker(pd_cluster, "decode").url
    for w in pd_cluster.workers:
        assert HTTP.get(w.url + "/internal/v1/transfer/metadata", params={"rank": 0},
                         headers=internal_headers(), timeout=10).status_code == 404
    response = HTTP.post(decode + "/internal/v1/transfer/reservation",
                          json={"rank": 0, "request_id": "anything", "reservation_token": "guess"},
                          headers=internal_headers(), timeout=10)
    assert response.status_code == 403 and "agent_metadata" not in response.text
