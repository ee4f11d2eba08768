"""An attacker inside the cluster who can reach a worker's port but holds no credential: every internal-API call is
refused with 401 and does nothing (no request runs, no KV stream opens, no memory key leaks); probes and metrics
stay open. The credential itself: where a process finds it, and that a second process on the machine agrees."""

import os
import stat

import pytest
from probes import HTTP, eventually, internal_headers, metric_total
from stream_calls import pages_at_rest

from pdserve.http.internal_auth import TOKEN_ENV, internal_token_from

WRONG_CREDENTIALS = {
    "none": {},
    "wrong token": {"authorization": "Bearer not-the-token"},
    "right token, wrong scheme": {"authorization": internal_headers()["authorization"].replace("Bearer", "Basic")},
    "right token + 1 char": {"authorization": internal_headers()["authorization"] + "x"},
    "API-key style header": {"x-api-key": internal_headers()["authorization"].split()[1]},
}
FORGED_PREFILL = {
    "request_id": "forged", "rank": 0, "prompt_token_ids": [5, 6, 7, 8] * 8, "sampling": {"max_tokens": 1},
    "plan": {"kind": "prefill", "destination": {"url": "http://169.254.169.254/latest", "rank": 0,
                                                "agent_name": "victim", "page_ids": [0, 1]}},
}


@pytest.fixture(scope="module")
def worker_urls(pd_cluster) -> list[str]:
    return [w.url for w in pd_cluster.workers]


@pytest.mark.parametrize("credential", sorted(WRONG_CREDENTIALS))
def test_every_internal_call_without_the_credential_is_refused_and_does_nothing(pd_cluster, worker_urls, credential):
    headers = WRONG_CREDENTIALS[credential]
    prompts_before = {url: metric_total(url, "pdserve_prompt_tokens_total") for url in worker_urls}
    for url in worker_urls:
        calls = [
            ("POST", "/internal/v1/generate", {"request_id": "attack", "rank": 0, "prompt_token_ids": [5, 6, 7],
                                               "sampling": {"max_tokens": 4}}),
            ("POST", "/internal/v1/generate", FORGED_PREFILL),
            ("POST", "/internal/v1/abort", {"request_id": "anything"}),
            ("GET", "/internal/v1/load", None), ("GET", "/internal/v1/info", None),
            ("GET", "/internal/v1/kv_events?rank=0&after=-1", None),
            ("GET", "/internal/v1/transfer/metadata?rank=0", None),
        ]
        for method, path, body in calls:
            response = HTTP.request(method, url + path, json=body, headers=headers, timeout=10)
            assert response.status_code == 401, (url, path, response.status_code)
            assert response.json()["error"]["code"] == "unauthorized"
            assert "agent_metadata" not in response.text and "page_size" not in response.text
    for url in worker_urls:  # nothing ran: no prompt was counted, no page is held
        assert metric_total(url, "pdserve_prompt_tokens_total") == prompts_before[url]
        assert eventually(lambda u=url: pages_at_rest(u), timeout_s=10)


def test_probes_and_metrics_need_no_credential_and_the_right_one_passes(worker_urls):
    for url in worker_urls:
        assert HTTP.get(url + "/health", timeout=10).status_code == 200
        assert HTTP.get(url + "/metrics", timeout=10).status_code == 200
        assert HTTP.get(url + "/internal/v1/info", headers=internal_headers(), timeout=10).status_code == 200


def test_a_process_finds_its_credential_file_first_then_environment_then_a_shared_default_file(tmp_path, monkeypatch):
    given = tmp_path / "given"
    given.write_text("from-file\n")
    assert internal_token_from(str(given), {TOKEN_ENV: "from-env"}) == "from-file"
    assert internal_token_from(None, {TOKEN_ENV: "from-env"}) == "from-env"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    first = internal_token_from(None, {})
    assert len(first) >= 32 and internal_token_from(None, {}) == first  # a second process on the machine agrees
    made = tmp_path / "state" / "pdserve" / "internal-token"
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o600
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        internal_token_from(str(tmp_path / "empty"), {})
