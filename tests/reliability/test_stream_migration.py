"""Request migration with real processes: the decode worker of a stream dies mid-stream (SIGKILL) and the router
continues the stream on the other decode worker with no token lost or repeated; output is token- and text-identical
to an undisturbed run, sampled with a seed and penalties too (the continued request names the streamed tokens: the
penalties count them, the seeded generator skips their draws). With no decode worker left, the stream ends with a clear
error event."""

import threading

import pytest
from probes import eventually, metric_total
from stream_calls import TIMEOUT_S, model_of, pages_at_rest, running, stream_completion

from pdserve.cluster.local import ClusterConfig, LocalCluster

MAX_TOKENS = 500
PROMPT = "a long story about a quick brown fox"
SEEDED = {"temperature": 0.8, "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": 0.3}


@pytest.fixture(scope="module")
def cluster(tiny_v2, ray_address, tmp_path_factory):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=2, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "256"),
                        log_dir=str(tmp_path_factory.mktemp("migration-logs")))
    with LocalCluster(cfg) as local:
        yield local


def stream_in_background(cluster, model: str) -> tuple[threading.Thread, dict]:
    """A long stream in a thread; returns once its tokens are arriving."""
    result: dict = {}
    streaming = threading.Event()
    thread = threading.Thread(target=lambda: result.setdefault(
        "stream", stream_completion(cluster.url, model, PROMPT, MAX_TOKENS, streaming=streaming, **SEEDED)))
    thread.start()
    assert streaming.wait(timeout=TIMEOUT_S)
    return thread, result


def serving_decode_worker(cluster):
    decode_workers = cluster.workers[1:]
    assert eventually(lambda: any(running(w.url) for w in decode_workers if w.process.poll() is None), timeout_s=60)
    return next(w for w in decode_workers if w.process.poll() is None and running(w.url))


def migrations_counted(cluster) -> float:
    return metric_total(cluster.url, "pdserve_router_migrations_total")


def test_killing_the_decode_worker_mid_stream_continues_the_stream_token_identically(cluster):
    model = model_of(cluster.url)
    undisturbed = stream_completion(cluster.url, model, PROMPT, MAX_TOKENS, **SEEDED)
    assert undisturbed.finish_reason == "length" and len(undisturbed.token_ids) == MAX_TOKENS

    thread, result = stream_in_background(cluster, model)
    victim = serving_decode_worker(cluster)
    cluster.kill(victim)
    thread.join(timeout=TIMEOUT_S)
    assert not thread.is_alive()
    migrated = result["stream"]
    assert not migrated.errors and migrated.done and migrated.finish_reason == "length"
    assert migrated.token_ids == undisturbed.token_ids  # nothing lost, nothing repeated, the same draws
    assert migrated.text == undisturbed.text
    assert migrations_counted(cluster) >= 1
    survivors = [w for w in cluster.workers if w.process.poll() is None]
    assert all(eventually(lambda w=w: pages_at_rest(w.url)) for w in survivors)


def test_a_stream_with_no_decode_worker_left_ends_with_a_clear_error_event(cluster):
    model = model_of(cluster.url)
    thread, result = stream_in_background(cluster, model)
    victim = serving_decode_worker(cluster)  # the last decode worker standing
    cluster.kill(victim)
    thread.join(timeout=TIMEOUT_S)
    assert not thread.is_alive()
    broken = result["stream"]
    assert broken.done and 0 < len(broken.token_ids) < MAX_TOKENS
    assert len(broken.errors) == 1 and "no other worker" in broken.errors[0]["message"]
