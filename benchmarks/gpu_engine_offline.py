"""Offline end-to-end throughput of the engine: N requests submitted at once, output tokens/s and mean ITL.

A random-weight model of the config's shape (`load_format="random"`: no checkpoint needed), greedy, ignore_eos,
so every request makes exactly --output tokens.

    python benchmarks/gpu_engine_offline.py                                # 512 x (1k prompt, 256 out), V2-Lite
    python benchmarks/gpu_engine_offline.py --config TINY_DIR/config.json --requests 8 --prompt 32 --output 8 \
        --device cpu --dtype float32                                       # smoke run of the script itself

Mean ITL is each request's (last token - first token) / (tokens - 1), averaged. In a burst the rest of a wave's
prefill runs after a request's first token, so the table also splits out that first gap: the mean ITL from the
second token on, and the median of every gap between consecutive tokens.
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
from pdserve.wire.sampling import SamplingParams

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--overlap-scheduling", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--compile-layers", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--compile-eager-steps", choices=("on", "off"), default="on")
    parser.add_argument("--piecewise-graphs", choices=("on", "off"), default="on")
    args = parser.parse_args()

    model_dir = Path(tempfile.mkdtemp())
    shutil.copy(args.config, model_dir / "config.json")
    engine = Engine(EngineConfig(
        model=str(model_dir), load_format="random", device=args.device, dtype=args.dtype, page_size=args.page_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt + args.output, enable_prefix_cache=False, cuda_graphs=not args.no_cuda_graphs,
        progress=False, overlap_scheduling=args.overlap_scheduling, compile_layers=args.compile_layers,
        compile_eager_steps=args.compile_eager_steps == "on", piecewise_graphs=args.piecewise_graphs == "on",
    ))
    vocab = engine.model_config.vocab_size
    sampling = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    engine.add_request("warm-up", [1] * args.prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()

    gen = torch.Generator().manual_seed(0)
    token_times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i in range(args.requests):
        engine.add_request(f"r{i}", torch.randint(2, vocab, (args.prompt,), generator=gen).tolist(), sampling)
        token_times[f"r{i}"] = []
    steps = 0
    full_decode_steps_s: list[float] = []  # decode-only steps of a nearly full batch: what a token costs at best
    while engine.has_work():
        step_started = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        shape = engine.last_step
        if shape.prefill_tokens == 0 and shape.decode_batch >= 0.9 * args.max_num_seqs:
            full_decode_steps_s.append(now - step_started)
        for out in outputs:
            token_times[out.request_id].extend([now] * len(out.new_token_ids))
    elapsed = time.perf_counter() - start

    output_tokens = sum(len(t) for t in token_times.values())
    ttft = [t[0] - start for t in token_times.values()]
    itl = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    first_gap = [t[1] - t[0] for t in token_times.values() if len(t) > 1]
    later_itl = [(t[-1] - t[1]) / (len(t) - 2) for t in token_times.values() if len(t) > 2]
    gaps = [b - a for t in token_times.values() for a, b in zip(t, t[1:])]
    graphs = engine.runner.decode_graphs
    print(f"device: {torch.cuda.get_device_name() if engine.device.type == 'cuda' else 'cpu'}; "
          f"{engine.model_config.num_hidden_layers} layers, {engine.dtype}; CUDA graphs: "
          f"{list(graphs.sizes) if graphs else 'off'}; {engine.allocator.num_pages} pages of {args.page_size}")
    print()
    full_step_ms = 1e3 * statistics.median(full_decode_steps_s) if full_decode_steps_s else float("nan")
    print(f"overlap scheduling: {engine.overlap_scheduling}")
    print("| requests | prompt | output | wall (s) | steps | output tokens/s | total tokens/s | mean TTFT (s) "
          "| mean ITL (ms) | mean first gap (ms) | mean ITL from the 2nd token (ms) | gap p50 (ms) "
          "| full-batch decode step p50 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    total = output_tokens + args.requests * args.prompt

    def mean_ms(values: list[float]) -> float:
        return 1e3 * sum(values) / len(values) if values else float("nan")

    print(f"| {args.requests} | {args.prompt} | {args.output} | {elapsed:.1f} | {steps} | {output_tokens / elapsed:,.0f} "
          f"| {total / elapsed:,.0f} | {sum(ttft) / len(ttft):.2f} | {mean_ms(itl):.1f} | {mean_ms(first_gap):.1f} | "
          f"{mean_ms(later_itl):.1f} | {1e3 * statistics.median(gaps) if gaps else float('nan'):.1f} | "
          f"{full_step_ms:.1f} |")
    assert output_tokens == args.requests * args.output, "every request makes exactly --output tokens"


if __name__ == "__main__":
    main()
