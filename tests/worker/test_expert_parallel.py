"""A real `pdserve worker --ranks 2 --expert-parallel` over Ray: both ranks serve the offline engine's tokens; a
killed rank makes the worker unhealthy, the instance restarts, nothing hangs, and it serves the same tokens again."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from probes import HTTP, health_status, internal_token, wait_for

from pdserve.http.ports import free_port
from pdserve.engine.llm import LLM
from pdserve.model.config import ModelConfig
from pdserve.wire.client import WorkerClient, WorkerSession
from pdserve.wire.protocol import GenerateRequest, TokenEvent
from pdserve.wire.sampling import SamplingParams

SAMPLING = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = {0: [[5, 17, 42, 9, 100, 3], [77, 8, 8, 61]], 1: [[12, 13, 14, 15, 16, 17, 18, 19, 20]]}
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 60.0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_actor_pids(worker_pid: int) -> list[int]:
    """Ray titles an actor's process `ray::RankActor...`; the worker started this Ray, so its actors descend from it."""
    pids = []
    for pid in descendants(worker_pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RankActor"):
                pids.append(pid)
        except OSError:
            continue
    return pids


def per_rank(url: str, metric: str) -> dict[int, float]:
    """A metric's samples summed per rank, as scraped."""
    totals: dict[int, float] = {}
    for line in HTTP.get(url + "/metrics", timeout=10.0).text.splitlines():
        if line.startswith(metric + "{"):
            rank = int(line.split('rank="', 1)[1].split('"', 1)[0])
            totals[rank] = totals.get(rank, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def generate(url: str, rank: int, prompt: list[int], request_id: str,
                   sampling: SamplingParams = SAMPLING) -> list[TokenEvent]:
    async with WorkerSession(internal_token()) as http:
        request = GenerateRequest(request_id, rank, prompt, sampling)
        return [event async for event in WorkerClient(url, http, 10.0).generate(request, REQUEST_TIMEOUT_S)]


async def generate_all(url: str, tag: str) -> dict[int, list[list[int]]]:
    jobs = {(rank, i): generate(url, rank, prompt, f"{tag}-{rank}-{i}")
            for rank, prompts in PROMPTS.items() for i, prompt in enumerate(prompts)}
    results = await asyncio.wait_for(asyncio.gather(*jobs.values()), REQUEST_TIMEOUT_S)
    by_key = dict(zip(jobs, results))
    for events in results:
        assert events[-1].finish_reason == "length", events[-1]
    return {rank: [[t for e in by_key[(rank, i)] for t in e.token_ids] for i in range(len(prompts))]
            for rank, prompts in PROMPTS.items()}


@contextlib.contextmanager
def started_worker(model: str, log_dir: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A healthy `pdserve worker --ranks 2 --expert-parallel` (its URL and process); stopped on leaving."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve", "worker", "--ranks", "2", "--expert-parallel", "--model", model,
               "--port", str(port), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    log_path = log_dir / "worker.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: health_status(url) == 200 or process.poll() is not None, START_TIMEOUT_S, "worker healthy")
        assert process.poll() is None, log_path.read_text()[-3000:]
        yield url, process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the session this test started: the worker and its Ray
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def ep_worker(tiny_v2, tmp_path_factory):
    # A replica slot a rank, re-planned every 3 steps: the tokens below must not change for it
    with started_worker(tiny_v2, tmp_path_factory.mktemp("ep-worker"), "--dtype", "float32", "--num-pages", "64",
                        "--redundant-experts", "1", "--expert-rebalance-steps", "3") as started:
        yield started


@pytest.fixture(scope="module")
def offline_tokens(tiny_v2) -> dict[int, list[list[int]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the rank actors: BLAS results may depend on the thread count
    try:
        llm = LLM(tiny_v2, dtype="float32", device="cpu", num_pages=64, progress=False)
        return {rank: [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling=SAMPLING)]
                for rank, prompts in PROMPTS.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(400)
def test_expert_parallel_worker_serves_offline_tokens_and_restarts_after_a_rank_dies(ep_worker, offline_tokens,
                                                                                     tiny_v2):
    url, process = ep_worker
    warm_up_pairs = per_rank(url, "pdserve_expert_tokens_total")  # the ranks' warm-up prompts were routed too
    assert asyncio.run(generate_all(url, "before")) == offline_tokens

    metrics = HTTP.get(url + "/metrics", timeout=10.0).text
    expert_bytes = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("pdserve_expert_weight_bytes{")]
    assert len(expert_bytes) == 2 and expert_bytes[0] == expert_bytes[1] > 0
    replicas = wait_for(lambda: (n := per_rank(url, "pdserve_expert_replica_slots_filled_total")) and n, 10.0,
                        "replica slots counted")
    assert replicas[0] == replicas[1] > 0  # the instance's count, on every rank

    # Each rank counts the routed pairs of its own tokens over every expert, both halves of the experts included.
    moe = ModelConfig.from_dir(tiny_v2)
    pairs_per_row = moe.num_experts_per_tok * sum(moe.is_moe_layer(i) for i in range(moe.num_hidden_layers))
    rows = {rank: sum(len(p) + SAMPLING.max_tokens - 1 for p in prompts) for rank, prompts in PROMPTS.items()}
    expected = {rank: warm_up_pairs[rank] + n * pairs_per_row for rank, n in rows.items()}
    wait_for(lambda: per_rank(url, "pdserve_expert_tokens_total") == expected, 10.0, "routed pairs counted per rank")

    actor_pids = wait_for(lambda: len(p := rank_actor_pids(process.pid)) == 2 and p, 10.0, "two rank actors")

    async def kill_mid_stream() -> list[TokenEvent]:
        long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        stream = asyncio.create_task(generate(url, 1, PROMPTS[1][0], "killed", long))
        await asyncio.sleep(1.0)  # the request is decoding on rank 1 (and so exchanging with rank 0)
        os.kill(actor_pids[0], signal.SIGKILL)
        return await asyncio.wait_for(stream, REQUEST_TIMEOUT_S)

    events = asyncio.run(kill_mid_stream())
    assert events[-1].finish_reason == "error", "the stream of a broken instance must end with an error"
    wait_for(lambda: health_status(url) == 503, 30.0, "worker reports unhealthy")
    wait_for(lambda: health_status(url) == 200, START_TIMEOUT_S, "worker healthy again after the restart")
    new_pids = rank_actor_pids(process.pid)
    assert len(new_pids) == 2 and not set(new_pids) & set(actor_pids), "every rank is a new process"
    assert asyncio.run(generate_all(url, "after")) == offline_tokens


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_ranks_exchange_by_writes_into_peer_memory_and_give_the_nccl_tokens(tiny_model_factory, tmp_path):
    """On a host of two GPUs the worker's rank actors, each of which Ray lets see only its own GPU, map each other's
    exchange buffers (expert_peer_writes auto) and decode under CUDA graphs with them the tokens the same worker
    decodes over NCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    # MLA's dimensions as flashinfer's GPU kernels take them
    model = tiny_model_factory("v2", kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16,
                               num_key_value_heads=16, qk_nope_head_dim=128, v_head_dim=128)
    tokens = {}
    for setting, transport in (("auto", 1.0), ("off", 0.0)):
        log_dir = tmp_path / setting
        log_dir.mkdir()
        with started_worker(model, log_dir, "--dtype", "bfloat16", "--num-pages", "512",
                            "--expert-peer-writes", setting) as (url, _):
            assert per_rank(url, "pdserve_expert_exchange_peer_writes") == {0: transport, 1: transport}
            tokens[setting] = asyncio.run(generate_all(url, setting))
    assert tokens["auto"] == tokens["off"]
