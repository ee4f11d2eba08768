"""Each benchmark script that runs on a CPU, run as its users run it (`python benchmarks/X.py ...` from the repository
root, its own process) with the smallest arguments that still take its whole path: it exits 0 and prints its table.
A benchmark that breaks then fails here, not when someone next measures with it.

Not run: the gpu_* scripts (CUDA only), chaos.py (tests/reliability/test_chaos.py), model_steps.py (a module the GPU
scripts import, no command line) and gpu_service_profile.py's CPU smoke run (tests/engine/test_profile_fit.py)."""

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.engine.step_shape import StepShape
from pdserve.engine.step_trace import StepTrace

ROOT = Path(__file__).resolve().parents[2]
V3_CONFIG = ROOT / "pdserve" / "model" / "configs" / "deepseek-v3.json"


def write_step_trace(path: Path) -> None:
    """A rank's step trace with decode steps at two batch sizes and past `--max-batch 4`, and prefill steps of one
    prompt and of several."""
    trace = StepTrace(path, flush_interval_s=3600)
    shapes = ([StepShape(1, 100.0)] * 3 + [StepShape(4, 100.0)] * 3 + [StepShape(8, 100.0)] * 2
              + [StepShape(prefill_tokens=64, prefill_seqs=1)] * 2 + [StepShape(prefill_tokens=128, prefill_seqs=2)])
    started_s = time.monotonic()
    for index, shape in enumerate(shapes):
        engine_ms = 2.0 + index
        trace.record(shape, started_s, engine_ms, started_s + engine_ms / 1e3)
        started_s += 0.01
    trace.close()


def write_chrome_trace(path: Path) -> None:
    """A gzipped profiler trace of one device: two kernels 20 us apart, a copy overlapping the second, one launch."""
    events = [{"ph": "X", "cat": "kernel", "name": "void gemm_kernel(float*)", "pid": 0, "tid": 7, "ts": 0, "dur": 10},
              {"ph": "X", "cat": "kernel", "name": "softmax_kernel", "pid": 0, "tid": 7, "ts": 30, "dur": 5},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 8, "ts": 32, "dur": 10},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1, "ts": 0, "dur": 3}]
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))


@dataclass(frozen=True)
class Case:
    script: str
    args: tuple[str, ...]  # "{tmp}" is the test's tmp_path, "{model}" the tiny V2 model
    expected: tuple[str, ...]  # lines or parts of lines the script prints when its whole path ran
    write_inputs: Callable[[Path], None] | None = None  # files the script reads, written into tmp_path
    timeout_s: float = 60.0


CASES = [
    Case("weight_memory.py", ("--config", str(V3_CONFIG), "--ranks", "1,8"),
         ("| EP ranks | experts per rank | bf16 replicated |", "| 8 | 32 |")),
    Case("gc_pause.py", ("--repeats", "1"),
         ("| imports | objects tracked | full collection, ms (median) | after gc.freeze(), ms |",)),
    Case("host_step.py", ("--batches", "2,4", "--context", "64", "--long", "128", "--steps", "5", "--profile"),
         ("| batch | host ms per decode step |", "| 4 |", "Ordered by: internal time")),
    Case("cpu_engine.py", ("--threads", "1"),  # its shapes are fixed: ~8 s
         ("phase    shape", "prefill  1 x 4096", "decode   64 seqs x 64 steps")),
    Case("step_trace_summary.py", ("{tmp}/steps.decode.rank0", "--bucket", "2", "--max-batch", "4"),
         ("8 decode-only, 3 prefill-only", "| batch | steps | mean context |", "| 4-5 | 3 | 100 |",
          "| prefill tokens | steps | mean tokens |", "| 1-1024, one prompt | 2 |", "| 1-1024, several prompts | 1 |",
          "2 steps ran more than 4 sequences"),
         write_inputs=lambda tmp: write_step_trace(tmp / "steps.decode.rank0")),
    Case("fit_trace_profile.py", ("{tmp}/steps.decode.rank0", "--batches", "1,4", "--contexts", "100",
                                  "--prefill-tokens", "64,128", "--every-prefill-step", "--out", "{tmp}/profile.json"),
         ("11 steps; decode ms (rows: batch, columns: context", "prefill ms: 64 tokens", "profile: "),
         write_inputs=lambda tmp: write_step_trace(tmp / "steps.decode.rank0")),
    Case("trace_gaps.py", ("{tmp}/rank0.json.gz", "--min-gap-us", "5"),
         ("device 0: 3 device events over 0.04 ms", "| 1 | 0.02 | 20 | gemm_kernel | softmax_kernel |",
          "| cudaLaunchKernel | 1 | 0.00 |"),
         write_inputs=lambda tmp: write_chrome_trace(tmp / "rank0.json.gz")),
    Case("kv_write_gil.py", ("--writes", "3", "--busy-intervals-ms", "0.5"),
         ("GIL switch interval", "busy Python  scattered")),
    Case("kv_transfer_bandwidth.py", ("--num-layers", "2", "--page-size", "16", "--kv-dim", "64", "--max-mib", "1"),
         ("pool: 2 layers x page 16 x kv_dim 64 bf16 = 4 KiB per page", "(GB/s)", "    1    256 |")),
    Case("host_kv_tier.py", ("--config", "{model}/config.json", "--lengths", "64", "--device", "cpu", "--dtype",
                             "float32", "--host-gib", "0.05", "--page-size", "16", "--repeats", "1"),
         ("| prompt | computed TTFT (ms) | device hit (ms) | host hit (ms) |", "| 64 |",
          "a host pool of 0.05 GiB: allocated in")),
    Case("kv_layer_streaming.py", ("--prompt-lengths", "64", "--repeats", "1"),
         ("write after (ms)  per layer (ms)", "     64 ")),
    Case("router_overhead.py", ("run", "--requests", "8", "--tokens", "4", "--floor", "--repeat", "2"),
         ("| scenario | concurrency | direct req/s | router req/s |", "| non-streaming, bare proxy | 16 |",
          "| streaming | 32 |")),
    Case("router_at_scale.py", ("--prefill-workers", "1", "--decode-workers", "1", "--ranks", "2", "--requests", "8",
                                "--request-rate", "50", "--groups", "2", "--system-prompt-len", "64",
                                "--output-tokens", "2", "--page-size", "16"),
         ("| ranks | cluster start (s) | decisions |", "| KV events ingested in service |"), timeout_s=120.0),
    # These two start their own Ray and real worker processes: ~15 s each.
    Case("worker_stream_rate.py", ("--concurrency", "2", "--output-tokens", "8"),
         ("| requests at once | completed |", "| 2 | 2 |"), timeout_s=120.0),
    Case("kv_transfer_in_service.py", ("--prompt-tokens", "32", "--concurrency", "1", "--requests-per-level", "2"),
         ("KV MB/req  write GB/s", "write GB/s = bytes written"), timeout_s=120.0),
    # Past CI's budget, run with `-m slow`: Ray and three workers, ~20 s; prefix_routing starts two clusters, ~40 s.
    pytest.param(Case("disagg_ttft.py", ("--repeats", "1", "--prompt-lengths", "32"),
                      ("colocated TTFT ms  P/D TTFT ms",), timeout_s=180.0), marks=pytest.mark.slow),
    pytest.param(Case("prefix_routing.py", ("--model", "{model}", "--prefill-ranks", "2", "--groups", "3",
                                            "--per-group", "2", "--system-prompt-len", "64", "--user-len", "8,16",
                                            "--output-tokens", "2", "--request-rate", "50",
                                            "--json", "{tmp}/prefix.json"),
                      ("| routing | prefill prefix-cache hit ratio |", "| prefix |", "| round_robin |"),
                      timeout_s=240.0), marks=pytest.mark.slow),
]


def run_script(script: str, args: list[str], tmp_path: Path, timeout_s: float, ray_address: str) -> str:
    """The script's stdout, once it has exited 0 within `timeout_s`; on a timeout its whole process group (the
    clusters and routers it started) is killed."""
    # default_model_dir() makes the tiny model here, not in a home directory other runs share. A script that starts a
    # cluster joins the test run's Ray (ray.init() reads RAY_ADDRESS) instead of starting one of its own.
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), "RAY_ADDRESS": ray_address}
    process = subprocess.Popen([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{script} ran past {timeout_s} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert process.returncode == 0, f"{script} exited {process.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return stdout


@pytest.mark.parametrize("bench", CASES, ids=lambda bench: bench.script.removesuffix(".py"))
def test_benchmark_script_runs_on_the_cpu_and_prints_its_table(bench: Case, tmp_path, tiny_v2, ray_address):
    if bench.write_inputs is not None:
        bench.write_inputs(tmp_path)
    args = [arg.format(tmp=tmp_path, model=tiny_v2) for arg in bench.args]
    stdout = run_script(bench.script, args, tmp_path, bench.timeout_s, ray_address)
    for expected in bench.expected:
        assert expected in stdout, f"{bench.script}: {expected!r} not in\n{stdout[-3000:]}"


def test_planner_day_trace_runs_a_compressed_day_then_plots_it(tmp_path, tiny_v2, ray_address):
    stdout = run_script("planner_day_trace.py", [
        "run", "--policy", "planner", "--model", tiny_v2, "--hour-s", "0.1", "--sim-time-scale", "1",
        "--output-len", "2", "4", "--interval-s", "0.2", "--start-delay-s", "0.1", "--scale-down-window-s", "0.5",
        "--max-workers", "2", "--out", str(tmp_path / "day")], tmp_path, 60.0, ray_address)
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["policy"] == "planner" and summary["requests"] > 0 and summary["failed"] == 0, summary
    stdout = run_script("planner_day_trace.py", ["plot", str(tmp_path / "day" / "planner.json"),
                                                 "--out-dir", str(tmp_path / "plots")], tmp_path, 60.0,
                        ray_address)
    assert "| policy | requests | failed | SLO attainment | GPU-hours per day |" in stdout
    assert (tmp_path / "plots" / "day_trace.png").is_file() and (tmp_path / "plots" / "slo_vs_gpu_hours.png").is_file()


# A cluster of real workers, warmed up on the CPU preset's prompts, then plots: ~25 s, kept in CI as the benchmark the
# P/D figures come from.
def test_pd_vs_colocated_runs_a_deployment_then_compares_it(tmp_path, ray_address):
    out = str(tmp_path / "out")
    stdout = run_script("pd_vs_colocated.py", ["run", "--deployment", "pd", "--rates", "8", "--window-s", "0.25",
                                               "--min-requests", "2", "--drain-s", "30", "--out", out], tmp_path, 240.0,
                        ray_address)
    assert "| deployment | rate (req/s) | completed |" in stdout and "| pd | 8 | 2/2 |" in stdout
    pools = re.search(r"KV pool pages: (\S+) ([\d,]+), (\S+) ([\d,]+)\)", stdout)  # both workers' pools, sized
    assert pools and {pools[1], pools[3]} == {"prefill-0", "decode-0"}, stdout[:2000]
    assert int(pools[2].replace(",", "")) > 0 and int(pools[4].replace(",", "")) > 0
    stdout = run_script("pd_vs_colocated.py", ["compare", "--out", out], tmp_path, 60.0, ray_address)
    assert "| pd | 8 | 2/2 |" in stdout and "pd: highest rate meeting the SLO" in stdout
