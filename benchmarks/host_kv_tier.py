"""Time to first token of one prompt three ways: computed, found in the device prefix cache, and copied back from the
host tier (`--host-kv-cache-gib`) after its pages were evicted; plus the copy-back's bytes per second.

A random-weight model of the config's shape, greedy, one output token; each length first runs a warm-up prompt of its
own tokens (kernels, graphs), and each row's three cases run on one engine, back to back, `--repeats` times (median).

    python benchmarks/host_kv_tier.py                                          # V2-Lite shape, 1k..16k prompts
    python benchmarks/host_kv_tier.py --config TINY_DIR/config.json --lengths 64,256 --device cpu --dtype float32 \
        --host-gib 0.5                                                          # smoke run of the script itself

The host case's prompt had every full page evicted into the host tier (`evict` of the whole pool), so its prefill
computes only its last partial page; the device case is the same prompt run again with its pages still cached.
Then, against the physical limits: the time a second host pool of --host-gib takes to allocate (pinned on CUDA),
and on CUDA the host link's own bandwidth (1 GiB copies each way between pinned and device memory).
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.host_kv_pool import HostKVPool
from pdserve.wire.sampling import SamplingParams

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def time_to_first_token_s(engine: Engine, request_id: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, ONE_TOKEN)
    while engine.has_work():
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host-gib", type=float, default=16.0)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    model_dir = Path(tempfile.mkdtemp())
    shutil.copy(args.config, model_dir / "config.json")
    engine = Engine(EngineConfig(
        model=str(model_dir), load_format="random", device=args.device, dtype=args.dtype, page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max(lengths) + 16, progress=False,
        host_kv_cache_gib=args.host_gib))
    cache, host = engine.prefix_cache, engine.prefix_cache.host_tier
    mc = engine.model_config
    page_bytes = mc.num_hidden_layers * args.page_size * mc.kv_dim * torch.finfo(engine.dtype).bits // 8
    vocab = mc.vocab_size
    gen = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if engine.device.type == 'cuda' else 'cpu'}; "
          f"{mc.num_hidden_layers} layers, {engine.dtype}; {engine.allocator.num_pages} device pages and "
          f"{host.num_slots} host pages of {args.page_size} tokens ({page_bytes / 2**20:.2f} MiB each)")
    print()
    print("| prompt | computed TTFT (ms) | device hit (ms) | host hit (ms) | computed / host | pages loaded "
          "| host hit - device hit (ms) | copy-back GB/s (upper bound of its time) |")
    print("|---|---|---|---|---|---|---|---|")
    for length in lengths:
        warm_up = torch.randint(2, vocab, (length,), generator=gen).tolist()
        time_to_first_token_s(engine, f"warm-{length}", warm_up)
        cache.evict(engine.allocator.num_pages)
        time_to_first_token_s(engine, f"warm-host-{length}", warm_up)  # the load's path, once
        computed, device_hit, host_hit, loaded = [], [], [], []
        for repeat in range(args.repeats):
            prompt = torch.randint(2, vocab, (length,), generator=gen).tolist()
            cache.evict(engine.allocator.num_pages)  # earlier prompts' pages out of the way (into the host tier)
            computed.append(time_to_first_token_s(engine, f"c{length}-{repeat}", prompt))
            device_hit.append(time_to_first_token_s(engine, f"d{length}-{repeat}", prompt))
            cache.evict(engine.allocator.num_pages)  # every page of the prompt now lives only in the host tier
            before = host.loaded_pages
            host_hit.append(time_to_first_token_s(engine, f"h{length}-{repeat}", prompt))
            loaded.append(host.loaded_pages - before)
        c_ms, d_ms, h_ms = (1e3 * statistics.median(times) for times in (computed, device_hit, host_hit))
        pages = statistics.median(loaded)
        assert pages == (length - 1) // args.page_size, f"expected every full page loaded, got {pages}"
        gbps = f"{pages * page_bytes / (h_ms - d_ms) / 1e6:.1f}" if h_ms > d_ms else "-"
        print(f"| {length:,} | {c_ms:.1f} | {d_ms:.1f} | {h_ms:.1f} | {c_ms / h_ms:.1f}x | {pages:.0f} "
              f"| {h_ms - d_ms:.2f} | {gbps} |")
    print()
    started = time.perf_counter()
    HostKVPool(engine.runner.kv_cache, args.host_gib)
    print(f"a host pool of {args.host_gib:g} GiB: allocated in {time.perf_counter() - started:.2f} s")
    if engine.device.type == "cuda":
        print(f"host link, 1 GiB copies: device -> host {link_gbps('to host'):.1f} GB/s, host -> device "
              f"{link_gbps('to device'):.1f} GB/s")


def link_gbps(direction: str, repeats: int = 8) -> float:
    pinned = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    source, target = (device, pinned) if direction == "to host" else (pinned, device)
    target.copy_(source)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return repeats * 2**30 / (time.perf_counter() - started) / 1e9


if __name__ == "__main__":
    main()
