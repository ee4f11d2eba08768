"""The KV transfer rate in service: a prefill worker and a decode worker (real processes, real NIXL), requests of one
prompt length sent to the decode worker at rising concurrency, and per level what the prefill side's metrics say
of its writes (bytes over seconds spent writing, p50/p99 of one write, bytes per descriptor) next to the requests
per second and the median TTFT.

    python benchmarks/kv_transfer_in_service.py                      # CPU: tiny model, float32 (a smoke run)
    python benchmarks/kv_transfer_in_service.py --device cuda        # GPU: V2-Lite shape, random bf16 weights,
                                                                     # one whole GPU per worker (2 GPUs)
    [--prompt-tokens 4096] [--concurrency 1,4,16] [--requests-per-level 64] [--nixl-progress-thread auto|on|off]
"""

import argparse
import asyncio
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.http.internal_auth import TOKEN_ENV
from pdserve.model.tiny import make_config_only_model, make_tiny_model
from pdserve.wire.client import WorkerClient, WorkerSession
from pdserve.wire.protocol import GenerateRequest, Plan, PrefillSource
from pdserve.wire.sampling import SamplingParams

V2_LITE_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"


def prefill_metrics(url: str) -> dict[str, float]:
    """Sums over ranks of the transfer series, and the write-time histogram's cumulative buckets."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("pdserve_kv_transfer"):
                key = sample.name + (f"le={sample.labels['le']}" if "le" in sample.labels else "")
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def write_time_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float:
    """The upper bound of the bucket holding quantile q of the writes between two scrapes."""
    buckets = sorted((float(k.split("le=")[1]), after[k] - before.get(k, 0.0))
                     for k in after if k.startswith("pdserve_kv_transfer_seconds_bucket"))
    total = buckets[-1][1] if buckets else 0.0
    return next((le for le, count in buckets if count >= q * total), float("inf"))


async def one_request(decode_url: str, prefill_url: str, prompt: list[int], index: int, http) -> float:
    request = GenerateRequest(f"xfer-{index}-{time.monotonic_ns()}", 0, prompt,
                              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              Plan("decode", prefill=PrefillSource(prefill_url, 0)))
    started = time.perf_counter()
    ttft = None
    async for event in WorkerClient(decode_url, http).generate(request, first_token_timeout_s=300):
        if event.error:
            raise RuntimeError(event.error)
        ttft = ttft if ttft is not None else time.perf_counter() - started
    assert ttft is not None
    return ttft


async def run_level(decode_url: str, prefill_url: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list[float]]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(prompts)):
        queue.put_nowait(index)
    ttfts: list[float] = []
    async with WorkerSession(os.environ[TOKEN_ENV]) as http:
        async def client() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                ttfts.append(await one_request(decode_url, prefill_url, prompts[index], index, http))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - started, ttfts


def cluster_config(device: str, progress_thread: str) -> tuple[ClusterConfig, str]:
    common = ("--no-prefix-cache", "--nixl-progress-thread", progress_thread, "--max-num-batched-tokens", "8192")
    if device == "cuda":
        model = make_config_only_model(tempfile.mkdtemp(), json.loads(V2_LITE_CONFIG.read_text()))
        args = ("--dtype", "bfloat16", "--load-format", "random", "--gpus-per-rank", "1", "--page-size", "64", *common)
        return (ClusterConfig(model=str(model), port=0, num_prefill=1, num_decode=1, worker_args=args,
                              start_timeout_s=900), "DeepSeek-V2-Lite shape, random bf16 weights, one GPU per worker")
    model = make_tiny_model(tempfile.mkdtemp(), overrides={"max_position_embeddings": 16384})
    return (ClusterConfig(model=str(model), port=0, num_prefill=1, num_decode=1,
                          worker_args=("--dtype", "float32", *common)), "tiny v2 model, float32, CPU")


def main() -> None:
    os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))  # the cluster's credential, which this script uses too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-level", type=int, default=32)
    parser.add_argument("--nixl-progress-thread", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    cfg, title = cluster_config(args.device, args.nixl_progress_thread)
    generator = torch.Generator().manual_seed(0)
    rows = []
    with LocalCluster(cfg) as cluster:
        prefill, decode = cluster.workers
        warm = [torch.randint(2, 500, (args.prompt_tokens,), generator=generator).tolist() for _ in range(2)]
        asyncio.run(run_level(decode.url, prefill.url, warm, 1))
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            prompts = [torch.randint(2, 500, (args.prompt_tokens,), generator=generator).tolist()
                       for _ in range(args.requests_per_level)]
            before = prefill_metrics(prefill.url)
            elapsed_s, ttfts = asyncio.run(run_level(decode.url, prefill.url, prompts, concurrency))
            after = prefill_metrics(prefill.url)
            delta = {k: after[k] - before.get(k, 0.0) for k in after}
            written, seconds = delta["pdserve_kv_transfer_bytes_total"], delta["pdserve_kv_transfer_seconds_sum"]
            rows.append((concurrency, len(prompts) / elapsed_s, written / len(prompts) / 1e6,
                         written / max(seconds, 1e-12) / 1e9, write_time_quantile(before, after, 0.5) * 1e3,
                         write_time_quantile(before, after, 0.99) * 1e3,
                         written / max(delta["pdserve_kv_transfer_descriptors_total"], 1) / 1e3,
                         statistics.median(ttfts) * 1e3))
    print(f"{title}; prompts of {args.prompt_tokens} tokens; NIXL progress thread {args.nixl_progress_thread}")
    print(f"{'conc':>5} {'req/s':>7} {'KV MB/req':>10} {'write GB/s':>11} {'write p50 ms':>13} {'write p99 ms':>13} "
          f"{'KB/descr':>9} {'TTFT p50 ms':>12}")
    for c, rate, mb, gbps, p50, p99, kb, ttft in rows:
        print(f"{c:5d} {rate:7.2f} {mb:10.2f} {gbps:11.2f} {p50:13.2f} {p99:13.2f} {kb:9.1f} {ttft:12.1f}")
    print("write GB/s = bytes written / seconds spent writing (pdserve_kv_transfer_bytes_total over "
          "pdserve_kv_transfer_seconds_sum); write p50/p99 = upper bound of the histogram bucket")


if __name__ == "__main__":
    main()
