"""TTFT added by disaggregation: one colocated (both) worker vs prefill worker -> NIXL -> decode worker, real
processes, prompts of 256 to 8k tokens; plus the KV transfer rate the prefill side saw.

    python benchmarks/disagg_ttft.py [--repeats 3]                 # CPU: tiny generated model, float32
    python benchmarks/disagg_ttft.py --device cuda                  # GPU: V2-Lite shape, random bf16 weights,
                                                                    # the three workers sharing one GPU (VRAM -> VRAM)
    [--nixl-progress-thread auto|on|off] [--prompt-lengths 256,1024]

Prints one table. TTFT here is measured at the worker API (no router), first streamed token.
"""

import argparse
import asyncio
import json
import os
import re
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.http.internal_auth import TOKEN_ENV
from pdserve.model.tiny import make_config_only_model, make_tiny_model
from pdserve.wire.client import WorkerClient, WorkerSession
from pdserve.wire.protocol import GenerateRequest, Plan, PrefillSource
from pdserve.wire.sampling import SamplingParams

PROMPT_LENGTHS = (256, 1024, 2048, 4096, 8192)
V2_LITE_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"


async def ttft_s(url: str, request: GenerateRequest) -> float:
    async with WorkerSession(os.environ[TOKEN_ENV]) as http:
        start = time.perf_counter()
        async for event in WorkerClient(url, http).generate(request, first_token_timeout_s=300):
            if event.error:
                raise RuntimeError(event.error)
            return time.perf_counter() - start
    raise RuntimeError("no token")


def transfer_totals(prefill_url: str) -> tuple[float, float]:
    text = httpx.get(prefill_url + "/metrics", timeout=10).text
    total = lambda name: sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))  # noqa: E731
    return total("pdserve_kv_transfer_bytes_total"), total("pdserve_kv_transfer_seconds_sum")


def cluster_config(device: str, progress_thread: str) -> tuple[ClusterConfig, str]:
    common = ("--no-prefix-cache", "--max-num-batched-tokens", "8192", "--nixl-progress-thread", progress_thread)
    if device == "cuda":
        # Three V2-Lite workers (31 GB of bf16 weights each) on one GPU: a share of it each, pools sized by hand.
        v2_lite_dir = make_config_only_model(tempfile.mkdtemp(), json.loads(V2_LITE_CONFIG.read_text()))
        worker_args = ("--dtype", "bfloat16", "--load-format", "random", "--gpus-per-rank", "0.3",
                       "--page-size", "64", "--num-pages", "512", "--max-num-seqs", "8", *common)
        return (ClusterConfig(model=str(v2_lite_dir), port=0, num_prefill=1, num_decode=1,
                              num_both=1, worker_args=worker_args, start_timeout_s=900),
                "DeepSeek-V2-Lite shape, random weights, bf16, three workers on one GPU (KV VRAM -> VRAM)")
    model = make_tiny_model(tempfile.mkdtemp(), overrides={"max_position_embeddings": 16384})
    return (ClusterConfig(model=str(model), port=0, num_prefill=1, num_decode=1, num_both=1,
                          worker_args=("--dtype", "float32", *common)),
            "tiny v2 model (3 layers, 40 cached values per token per layer), float32, one host")


def main() -> None:
    os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))  # the cluster's credential, which this script uses too
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nixl-progress-thread", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--prompt-lengths", default=",".join(map(str, PROMPT_LENGTHS)))
    args = parser.parse_args()
    cfg, title = cluster_config(args.device, args.nixl_progress_thread)
    title += f"; NIXL progress thread {args.nixl_progress_thread}"
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with LocalCluster(cfg) as cluster:
        prefill, decode, both = cluster.workers
        for n in (int(n) for n in args.prompt_lengths.split(",")):
            colocated, disaggregated = [], []
            bytes_before, seconds_before = transfer_totals(prefill.url)
            for i in range(args.repeats + 1):  # the first of each is a warm-up
                prompt = torch.randint(2, 500, (n,), generator=gen).tolist()
                c = asyncio.run(ttft_s(both.url, GenerateRequest(f"c{n}-{i}", 0, prompt, sampling, Plan("both"))))
                d = asyncio.run(ttft_s(decode.url, GenerateRequest(
                    f"d{n}-{i}", 0, prompt, sampling, Plan("decode", prefill=PrefillSource(prefill.url, 0)))))
                if i:
                    colocated.append(c)
                    disaggregated.append(d)
            bytes_after, seconds_after = transfer_totals(prefill.url)
            rate = (bytes_after - bytes_before) / max(seconds_after - seconds_before, 1e-9) / 1e9
            kv_mb = (bytes_after - bytes_before) / (args.repeats + 1) / 1e6
            c_ms, d_ms = statistics.median(colocated) * 1e3, statistics.median(disaggregated) * 1e3
            rows.append((n, c_ms, d_ms, d_ms - c_ms, kv_mb, rate))
    print(title)
    print(f"{'prompt':>7} {'colocated TTFT ms':>18} {'P/D TTFT ms':>12} {'added ms':>9} {'KV MB':>7} {'transfer GB/s':>14}")
    for n, c_ms, d_ms, added, kv_mb, rate in rows:
        print(f"{n:7d} {c_ms:18.1f} {d_ms:12.1f} {added:9.1f} {kv_mb:7.2f} {rate:14.2f}")


if __name__ == "__main__":
    main()
