"""How fast tokens leave a worker at a large batch: one `both` worker on the simulated engine (no model: each step
sleeps what the profile predicts, docs/simulation.md) behind the router, N requests at once, each making the same
number of tokens. The steps' own time comes from the worker's step trace; what reaches the client is the benchmark
client's output tokens/s and inter-token gaps. Where the path from the rank to the client (the Ray hop, the worker's
HTTP edge, the router) cannot carry what the steps make, the client's ITL exceeds the step's turn and the wall time
exceeds the steps'.

    python benchmarks/worker_stream_rate.py [--concurrency 32,256] [--output-tokens 200]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.bench.client import RunLimits
from pdserve.bench.report import SLO
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workload import LengthRange, WorkloadConfig
from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.engine.step_trace import rank_trace_path, read_trace
from pdserve.model.tiny import make_tiny_model

LIMIT_S = 120.0


def measure(concurrency: int, output_tokens: int, seed: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="stream-rate-"))
    trace = out / "steps"
    cfg = ClusterConfig(str(make_tiny_model(out / "model")), port=0, num_prefill=0, num_decode=0, num_both=1,
                        log_dir=str(out / "logs"), worker_args=(
                            "--engine", "simulated", "--max-num-seqs", str(max(concurrency, 1)), "--no-warmup",
                            "--step-trace", str(trace)))
    with LocalCluster(cfg) as cluster:
        workload = WorkloadConfig(num_requests=concurrency, seed=seed, max_concurrency=concurrency,
                                  prompt_len=LengthRange(64, 64), output_len=LengthRange(output_tokens, output_tokens),
                                  token_id_high=400)
        started = time.monotonic()
        result = run_benchmark(cluster.url, workload, SLO(LIMIT_S, LIMIT_S), RunLimits(LIMIT_S, LIMIT_S),
                               progress=False, label=f"c={concurrency}")
        wall_s = time.monotonic() - started
        time.sleep(1.0)  # the idle loop writes its last steps
        steps = read_trace(Path(rank_trace_path(str(trace), "both", 0)))
    full = [s for s in steps if s.shape.decode_batch == concurrency and not s.shape.prefill_tokens]
    summary = result["summary"]
    return {"concurrency": concurrency, "completed": summary["completed"], "wall_s": wall_s,
            "steps_s": sum(s.turn_ms for s in steps) / 1000, "tok_s": summary["completed"] * output_tokens / wall_s,
            "turn_ms": statistics.median(s.turn_ms for s in full) if full else float("nan"),
            "itl_p50_ms": (summary["itl_s"]["p50"] or 0.0) * 1000, "itl_p99_ms": (summary["itl_s"]["p99"] or 0.0) * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="32,256")
    parser.add_argument("--output-tokens", type=int, default=200)
    args = parser.parse_args()
    rows = [measure(int(c), args.output_tokens, seed) for seed, c in enumerate(args.concurrency.split(","))]
    print("| requests at once | completed | wall s | steps' own s | output tok/s | full-batch step turn ms (median) | "
          "ITL p50 / p99 ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['concurrency']} | {r['completed']} | {r['wall_s']:.1f} | {r['steps_s']:.1f} | {r['tok_s']:,.0f} | "
              f"{r['turn_ms']:.1f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    return 0 if all(r["completed"] == r["concurrency"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
