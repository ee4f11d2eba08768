"""What serving costs: the offline engine's output tokens/s against the same workload sent through router + worker
over HTTP at the same concurrency, in one run on one machine.

Both sides: a random-weight model of the config's shape, greedy, ignore_eos, every request makes exactly --output
tokens, all --requests submitted at once, prefix cache off. The offline engine runs first in this process and is
freed; then a local cluster (one `both` worker, one router) serves the same request count and lengths, and the
bench client streams them (`/v1/completions`, one SSE event per token batch).

    python benchmarks/gpu_serving_vs_offline.py                       # 512 x (1k prompt, 256 out), V2-Lite shape, GPU
    python benchmarks/gpu_serving_vs_offline.py --config TINY/config.json --requests 8 --prompt 32 --output 8 --cpu \
        --token-id-high 500
"""

import argparse
import gc
import json
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench.client import RunLimits
from pdserve.bench.report import SLO
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workload import LengthRange, WorkloadConfig
from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.step_trace import FLUSH_INTERVAL_S, rank_trace_path, read_trace
from pdserve.model.tiny import make_config_only_model
from pdserve.wire.sampling import SamplingParams

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"


@dataclass
class StepTotals:
    """Where a run's steps went: how many, the engine's seconds in them, and the run's wall seconds."""

    steps: int
    engine_s: float
    wall_s: float
    decode_batch_mean: float = 0.0  # served only: from the step trace's shapes

    def row(self, name: str, output_tokens: int) -> str:
        batch = f"{self.decode_batch_mean:.0f}" if self.decode_batch_mean else "-"
        return (f"| {name} | {self.steps:,} | {output_tokens / self.steps:.1f} | {batch} | {self.engine_s:.1f} | "
                f"{self.wall_s:.1f} | {self.engine_s / self.wall_s:.2f} |")


def offline_output_tokens_per_s(model_dir: Path, args: argparse.Namespace) -> tuple[float, StepTotals]:
    engine = Engine(EngineConfig(
        model=str(model_dir), load_format="random", device="cpu" if args.cpu else "auto",
        dtype="float32" if args.cpu else "auto", page_size=args.page_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.prompt + args.output,
        enable_prefix_cache=False, progress=False, overlap_scheduling=args.overlap_scheduling,
    ))
    sampling = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    engine.add_request("warm-up", [5] * args.prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    generator = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    start = time.perf_counter()
    for i in range(args.requests):
        engine.add_request(f"r{i}", torch.randint(3, vocab, (args.prompt,), generator=generator).tolist(), sampling)
    output_tokens = steps = 0
    engine_s = 0.0
    while engine.has_work():
        step_started = time.perf_counter()
        output_tokens += sum(len(out.new_token_ids) for out in engine.step())
        engine_s += time.perf_counter() - step_started
        steps += 1
    elapsed = time.perf_counter() - start
    assert output_tokens == args.requests * args.output, "every request makes exactly --output tokens"
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return output_tokens / elapsed, StepTotals(steps, engine_s, elapsed)


def served_summary(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> tuple[dict, StepTotals]:
    """The bench summary of the served run, and its steps as the worker's step trace saw them."""
    trace = log_dir / "step-trace.jsonl"
    rank_trace = Path(rank_trace_path(str(trace), "both", 0))
    worker_args = ["--load-format", "random", "--page-size", str(args.page_size), "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-model-len", str(args.prompt + args.output), "--no-prefix-cache", "--step-trace", str(trace)]
    worker_args += ["--dtype", "float32"] if args.cpu else ["--dtype", "bfloat16", "--gpus-per-rank", "1"]
    worker_args += shlex.split(args.worker_args) + ["--overlap-scheduling", args.overlap_scheduling]
    cfg = ClusterConfig(str(model_dir), port=0, num_prefill=0, num_decode=0, num_both=1, worker_args=tuple(worker_args),
                        start_timeout_s=480.0, log_dir=str(log_dir))
    lengths = dict(prompt_len=LengthRange(args.prompt, args.prompt), output_len=LengthRange(args.output, args.output))
    with LocalCluster(cfg) as cluster:
        warm = WorkloadConfig(num_requests=2, seed=1, max_concurrency=1, prompt_len=LengthRange(args.prompt, args.prompt),
                              output_len=LengthRange(4, 4), token_id_high=args.token_id_high)
        run_benchmark(cluster.url, warm, SLO(60.0, 60.0), RunLimits(300.0, 400.0), progress=False)
        time.sleep(2 * FLUSH_INTERVAL_S)  # the idle loop has flushed the warm-up's steps
        warm_steps = len(read_trace(rank_trace))
        workload = WorkloadConfig(num_requests=args.requests, seed=0, max_concurrency=args.requests,
                                  token_id_high=args.token_id_high, **lengths)
        result = run_benchmark(cluster.url, workload, SLO(600.0, 600.0), RunLimits(600.0, 900.0), progress=False)
        time.sleep(2 * FLUSH_INTERVAL_S)
    records = read_trace(rank_trace)[warm_steps:]
    wall_s = records[-1].t_s + records[-1].turn_ms / 1e3 - records[0].t_s
    decode_steps = [r for r in records if r.shape.decode_batch]
    totals = StepTotals(len(records), sum(r.engine_ms for r in records) / 1e3, wall_s,
                        sum(r.shape.decode_batch for r in decode_steps) / max(1, len(decode_steps)))
    return result["summary"], totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--token-id-high", type=int, default=100_000, help="prompt token ids drawn below this")
    parser.add_argument("--cpu", action="store_true", help="smoke run of the script on the CPU (float32)")
    parser.add_argument("--overlap-scheduling", choices=("auto", "on", "off"), default="auto",
                        help="both sides (the engine's setting; auto: on for GPU devices)")
    parser.add_argument("--worker-args", default="", help="more `pdserve worker` flags, one string")
    parser.add_argument("--log-dir", default=tempfile.mkdtemp(prefix="serving-vs-offline-"))
    args = parser.parse_args()

    # The config's shape with the tiny tokenizer (the router needs one; prompts are token ids anyway).
    model_dir = make_config_only_model(tempfile.mkdtemp(), json.loads(Path(args.config).read_text()))
    offline, offline_steps = offline_output_tokens_per_s(model_dir, args)
    print(f"offline engine: {offline:,.0f} output tok/s", flush=True)
    served, served_steps = served_summary(model_dir, args, Path(args.log_dir))
    print(f"served: {served['output_tokens_per_s']:,.0f} output tok/s ({served['completed']}/{served['num_requests']} ok)")
    print()
    print("| requests | prompt | output | offline output tok/s | router + worker output tok/s | served / offline "
          "| served TTFT p50 (s) | served ITL p50 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.requests} | {args.prompt} | {args.output} | {offline:,.0f} | {served['output_tokens_per_s']:,.0f} | "
          f"{served['output_tokens_per_s'] / offline:.2f} | {served['ttft_s']['p50']:.2f} | "
          f"{served['itl_s']['p50'] * 1e3:.1f} |")
    print()
    print("| run | steps | output tokens per step | mean decode batch | engine s | wall s (first step to last) "
          "| engine / wall |")
    print("|---|---|---|---|---|---|---|")
    output_tokens = args.requests * args.output
    print(offline_steps.row("offline", output_tokens))
    print(served_steps.row("served", output_tokens))


if __name__ == "__main__":
    main()
