"""Measures a step profile in service: one `both` worker with its step trace on (docs/simulation.md) serves
calibration load through the router's OpenAI API, and the trace is fitted into a profile the simulated engine loads
(`--engine simulated --profile FILE`). A kernel profile times the GPU step alone; this one carries the host's work
around every step (scheduling, sampling, streaming outputs to the HTTP edge, the Ray hop). With `--deployment pd` a
prefill and a decode worker share the one GPU (half of it each in Ray's books, --pd-pages KV pages each): prefill
points come from the prefill worker's trace, decode points from the decode worker's, whose steady steps run while
the prefill worker is idle, so they time a decode rank as P/D runs it (KV arriving over NIXL, the hand-off's
receiver on its event loop).

Load, after a short warm-up whose steps are not used:
  prefill  single prompts (--prefill-prompts, each --prefill-repeats times, one at a time, one output token): a step
           of one prompt's chunk alone per point (prompts longer than the token budget give budget-sized chunks);
  decode   for each concurrency x prompt length, that many requests at once, each making the same number of tokens
           (ignore_eos): at least --output-tokens, and twice the steps the cell's prefills take, so that the whole
           batch decodes together for a while. Only the cell's decode-only steps at its full batch are used.
A cell whose estimated time would pass --deadline-s, or whose batch the KV pool cannot hold at once, is skipped and
said so; the fit names the grid points left without steps. Written to --out: service-profile.json (the profile),
service-profile-run.json (every phase and the comparison), step-trace.jsonl.ROLE.rank0 (the traces) and logs/ (the
cluster's logs and the rank actors' Ray logs).

    python benchmarks/gpu_service_profile.py --out $OUT                  # one GPU, DeepSeek-V2-Lite shape, random bf16
    python benchmarks/gpu_service_profile.py --deployment pd --out $OUT  # the same as a P/D pair on one GPU
    python benchmarks/gpu_service_profile.py --smoke --out /tmp/profile  # CPU smoke run: tiny model, small sizes
"""

import argparse
import json
import math
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from pdserve.bench.client import RunLimits
from pdserve.bench.report import SLO
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workload import LengthRange, WorkloadConfig
from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.engine.profile_fit import FitGrid, fit_profile
from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.engine.step_trace import StepRecord, rank_trace_path, read_trace
from pdserve.http.internal_auth import bearer_headers

T0 = time.monotonic()
V2_LITE = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"
STOP_RESERVE_S = 45.0  # kept free at the end: fitting, stopping the cluster, copying its logs
RAY_LOGS = Path("/tmp/ray/session_latest/logs")  # the rank actors log here: the cluster's Ray, the latest as it starts
RAY_LOG_BYTES = 1_000_000  # the tail kept of each
ROLES = {"both": dict(num_prefill=0, num_decode=0, num_both=1), "pd": dict(num_prefill=1, num_decode=1, num_both=0)}


@dataclass(frozen=True)
class Sizes:
    concurrency: tuple[int, ...]
    prompts: tuple[int, ...]
    output_tokens: int
    prefill_prompts: tuple[int, ...]
    prefill_repeats: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    token_id_high: int  # prompt token ids are drawn below this


GPU = Sizes((1, 16, 64, 256), (1024, 4096), 128, (1024, 4096, 16384), 3, 256, 8192, 64, 100_000)
SMOKE = Sizes((1, 4), (64, 192), 24, (64, 192, 512), 2, 16, 256, 16, 500)


@dataclass(frozen=True)
class Phase:
    kind: str  # warm-up, prefill or decode
    concurrency: int
    prompt: int
    output_tokens: int
    requests: int

    @property
    def label(self) -> str:
        return f"{self.kind} c={self.concurrency} p={self.prompt} out={self.output_tokens} n={self.requests}"

    def pages(self, page_size: int) -> int:
        """KV pages the cell's whole batch holds at its end."""
        return self.concurrency * math.ceil((self.prompt + self.output_tokens) / page_size)

    def steady(self, record: StepRecord) -> bool:
        """A step this phase measures: one prompt's chunk alone, or a decode-only step of the whole batch."""
        shape = record.shape
        if self.kind == "prefill":
            return shape.prefill_seqs == 1 and not shape.decode_batch
        return self.kind == "decode" and shape.decode_batch == self.concurrency and not shape.prefill_tokens

    def predicted_s(self, kernel: StepProfile, budget: int) -> float:
        """What the kernel profile says its steps take: the prefill steps and then the decode steps of each round."""
        rounds = math.ceil(self.requests / self.concurrency)
        prompt_tokens = self.concurrency * self.prompt
        prefill_ms = math.ceil(prompt_tokens / budget) * kernel.prefill_step_ms(min(prompt_tokens, budget))
        decode_ms = (self.output_tokens - 1) * kernel.decode_step_ms(self.concurrency,
                                                                     self.prompt + self.output_tokens / 2)
        return rounds * (prefill_ms + decode_ms) / 1000


def say(event: str, **fields) -> None:
    text = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    print(f"[{time.monotonic() - T0:6.1f}s] {event} {text}".rstrip(), flush=True)


def plan(sizes: Sizes, kernel: StepProfile, deployment: str) -> list[Phase]:
    budget = sizes.max_num_batched_tokens
    phases = [Phase("warm-up", min(4, sizes.max_num_seqs), sizes.prompts[0], 8, min(4, sizes.max_num_seqs)),
              Phase("warm-up", 1, max(sizes.prefill_prompts), 2, 1)]
    phases += [Phase("prefill", 1, prompt, 1, sizes.prefill_repeats) for prompt in sizes.prefill_prompts]
    for concurrency in sizes.concurrency:
        for prompt in sizes.prompts:
            # Decode runs twice as long as the batch's prefills take, so that the whole batch decodes together for a
            # while: one decode step per prefill chunk where one worker runs both, as many as fit in a chunk's time
            # where a decode worker steps on while the prefill worker works through the chunks.
            prefill_tokens = concurrency * prompt
            per_chunk = 1 if deployment == "both" else math.ceil(
                kernel.prefill_step_ms(min(prefill_tokens, budget)) / kernel.decode_step_ms(concurrency, prompt))
            output_tokens = max(sizes.output_tokens, 2 * math.ceil(prefill_tokens / budget) * per_chunk)
            phases.append(Phase("decode", concurrency, prompt, output_tokens, concurrency))
    return phases


def fit_grid(sizes: Sizes) -> FitGrid:
    budget = sizes.max_num_batched_tokens
    chunks = {1} | {min(prompt, budget) for prompt in sizes.prefill_prompts}
    return FitGrid(tuple(sizes.concurrency), tuple(p + sizes.output_tokens // 2 for p in sizes.prompts),
                   tuple(sorted(chunks)))


def settled_trace(path: Path, timeout_s: float = 5.0) -> list[StepRecord]:
    """The trace once the idle worker has written its last steps (it writes when its loop goes idle)."""
    deadline, last = time.monotonic() + timeout_s, -1
    while True:
        records = read_trace(path) if path.exists() else []
        if len(records) == last or time.monotonic() > deadline:
            return records
        last = len(records)
        time.sleep(0.3)


def run_phase(url: str, phase: Phase, sizes: Sizes, seed: int, limit_s: float) -> dict:
    workload = WorkloadConfig(num_requests=phase.requests, seed=seed, max_concurrency=phase.concurrency,
                              prompt_len=LengthRange(phase.prompt, phase.prompt),
                              output_len=LengthRange(phase.output_tokens, phase.output_tokens),
                              token_id_high=sizes.token_id_high)
    result = run_benchmark(url, workload, SLO(limit_s, limit_s), RunLimits(limit_s, limit_s), progress=False,
                           label=phase.label)
    summary = result["summary"]
    errors = sorted({r["error"][:200] for r in result["requests"] if not r["ok"]})[:3]
    return {"completed": summary["completed"], "itl_p50_ms": (summary["itl_s"]["p50"] or 0.0) * 1000,
            "errors": errors}


def comparison(profile: dict, kernel: StepProfile) -> list[dict]:
    rows = []
    decode, samples = profile["decode_ms"], profile["samples"]
    for b, batch in enumerate(decode["batches"]):
        for c, context in enumerate(decode["contexts"]):
            rows.append({"point": f"decode batch {batch} ctx {context:g}", "service_ms": decode["ms"][b][c],
                         "kernel_ms": kernel.decode_step_ms(batch, context), "steps": samples["decode"][b][c]})
    for tokens, ms, steps in zip(profile["prefill_ms"]["tokens"], profile["prefill_ms"]["ms"], samples["prefill"]):
        rows.append({"point": f"prefill {tokens} tokens", "service_ms": ms, "kernel_ms": kernel.prefill_step_ms(tokens),
                     "steps": steps})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| point | service ms | kernel ms | service / kernel | steps |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['point']} | {r['service_ms']:.2f} | {r['kernel_ms']:.2f} | "
              f"{r['service_ms'] / r['kernel_ms']:.2f} | {r['steps']} |" for r in rows]
    return "\n".join(lines)


def traces(out: Path, deployment: str) -> dict[str, Path]:
    """The trace each phase kind's steps are read from: the worker that runs them."""
    roles = {"warm-up": "both", "prefill": "both", "decode": "both"} if deployment == "both" else \
        {"warm-up": "decode", "prefill": "prefill", "decode": "decode"}
    return {kind: Path(rank_trace_path(str(out / "step-trace.jsonl"), role, 0)) for kind, role in roles.items()}


def cluster_config(args: argparse.Namespace, sizes: Sizes, kernel: StepProfile, trace: Path,
                   log_dir: Path) -> ClusterConfig:
    from pdserve.model.tiny import make_config_only_model, make_tiny_model

    if args.smoke:
        model = make_tiny_model(tempfile.mkdtemp(prefix="service-profile-model-"))
        device = ["--device", "cpu", "--dtype", "float32"]
    else:
        model = make_config_only_model(tempfile.mkdtemp(prefix="service-profile-model-"),
                                       json.loads(Path(args.config).read_text()))
        device = ["--device", args.device, "--load-format", "random", "--gpus-per-rank", "1"]
        if args.deployment == "pd":  # both workers on the one GPU
            device += ["--gpus-per-rank", "0.5", "--num-pages", str(args.pd_pages)]
    longest = max(max(sizes.prefill_prompts) + 1, max(p.prompt + p.output_tokens for p in plan(sizes, kernel, args.deployment)))
    worker_args = [*device, "--page-size", str(sizes.page_size), "--max-num-seqs", str(sizes.max_num_seqs),
                   "--max-num-batched-tokens", str(sizes.max_num_batched_tokens),
                   "--max-model-len", str(longest + sizes.page_size), "--no-prefix-cache", "--step-trace", str(trace),
                   *args.worker_args.split()]
    start_timeout_s = max(30.0, args.deadline_s - (time.monotonic() - T0) - STOP_RESERVE_S - 30.0)
    return ClusterConfig(str(model), port=0, worker_args=tuple(worker_args), start_timeout_s=start_timeout_s,
                         log_dir=str(log_dir), **ROLES[args.deployment])


def calibrate(cluster: LocalCluster, args: argparse.Namespace, sizes: Sizes, kernel: StepProfile,
              trace_of: dict[str, Path], record: dict) -> list[StepRecord]:
    """Runs every phase that fits before the deadline; returns the steps the phases measure."""
    decoder = next(w for w in cluster.workers if not w.name.startswith("prefill"))
    info = httpx.get(decoder.url + "/internal/v1/info", headers=bearer_headers(cluster.internal_token),
                     timeout=10).json()
    pool_pages = min(r["num_pages"] for r in info["ranks"])
    say("worker-ready", pool_tokens=pool_pages * sizes.page_size)
    used: list[StepRecord] = []
    seen = {path: 0 for path in set(trace_of.values())}
    # Wall time over the kernel profile's prediction: the largest seen in a decode cell so far; before any, about
    # twice (what service adds to the kernel) and some.
    slowdown = 3.0
    for index, phase in enumerate(plan(sizes, kernel, args.deployment)):
        left_s = args.deadline_s - (time.monotonic() - T0) - STOP_RESERVE_S
        estimate_s = phase.predicted_s(kernel, sizes.max_num_batched_tokens) * slowdown + 3.0
        if phase.kind != "warm-up" and estimate_s > left_s:
            say("skip", phase=phase.label, estimate_s=estimate_s, left_s=left_s, reason="deadline")
            record["skipped"].append(phase.label)
            continue
        if phase.pages(sizes.page_size) > pool_pages:  # the batch would never be whole: no steady step
            say("skip", phase=phase.label, pages=phase.pages(sizes.page_size), pool_pages=pool_pages, reason="kv")
            record["skipped"].append(phase.label)
            continue
        started = time.monotonic()
        outcome = run_phase(cluster.url, phase, sizes, seed=index, limit_s=max(10.0, left_s))
        wall_s = time.monotonic() - started
        steps: list[StepRecord] = []
        for path in seen:  # every trace moves on; the phase's steps are in its own
            records = settled_trace(path)
            if path == trace_of[phase.kind]:
                steps = records[seen[path]:]
            seen[path] = len(records)
        steady = [r for r in steps if phase.steady(r)]
        median_ms = statistics.median(r.turn_ms for r in steady) if steady else float("nan")
        if phase.kind != "warm-up":
            used += steady
        if phase.kind == "decode":
            ratio = wall_s / phase.predicted_s(kernel, sizes.max_num_batched_tokens)
            slowdown = max(slowdown, ratio) if any(p["kind"] == "decode" for p in record["phases"]) else ratio
        say("phase", phase=phase.label, ok=f"{outcome['completed']}/{phase.requests}", wall_s=wall_s,
            steps=len(steps), steady=len(steady), steady_median_ms=median_ms, itl_p50_ms=outcome["itl_p50_ms"])
        if outcome["errors"]:
            say("errors", phase=phase.label, first=outcome["errors"])
        record["phases"].append({**asdict(phase), **outcome, "wall_s": wall_s, "steps": len(steps),
                                 "steady_steps": len(steady), "steady_median_ms": median_ms})
    return used


def copy_ray_logs(session_logs: Path | None, target: Path) -> None:
    if session_logs is None or not session_logs.exists():
        return
    target.mkdir(parents=True, exist_ok=True)
    for log in session_logs.glob("*"):
        if log.is_file() and log.stat().st_size and log.name.startswith(("worker-", "raylet.")):
            (target / log.name).write_bytes(log.read_bytes()[-RAY_LOG_BYTES:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="service-profile-"))
    parser.add_argument("--deadline-s", type=float, default=560.0, help="from the script's start; phases that would "
                                                                         "end later are skipped")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run: the tiny model and small sizes")
    parser.add_argument("--config", default=str(V2_LITE), help="model config.json whose shape is served (random "
                                                               "weights)")
    parser.add_argument("--device", default="auto", help="the worker's torch device")
    parser.add_argument("--kernel-profile", default=str(DEFAULT_PROFILE), help="compared against; its KV figures "
                                                                                "are copied into the fit")
    parser.add_argument("--worker-args", default="", help="extra `pdserve worker` flags, space-separated")
    parser.add_argument("--deployment", choices=tuple(ROLES), default="both", help="one `both` worker, or a "
                                                                                    "prefill and a decode worker")
    parser.add_argument("--pd-pages", type=int, default=12_000, help="KV pages per worker when a P/D pair shares "
                                                                     "the GPU")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else GPU
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    trace_of = traces(out, args.deployment)
    for path in trace_of.values():
        path.unlink(missing_ok=True)
    kernel = StepProfile.load(args.kernel_profile)
    cfg = cluster_config(args, sizes, kernel, out / "step-trace.jsonl", out / "logs")
    record: dict = {"sizes": asdict(sizes), "worker_args": list(cfg.worker_args), "phases": [], "skipped": []}
    say("start", out=str(out), smoke=args.smoke, deadline_s=args.deadline_s)
    cluster, used, failed, ray_logs = LocalCluster(cfg), [], False, None
    try:
        cluster.start()
        ray_logs = RAY_LOGS.resolve()
        say("cluster-up", router=cluster.url)
        used = calibrate(cluster, args, sizes, kernel, trace_of, record)
    except BaseException:  # noqa: BLE001 - report it, then fit what was measured
        failed = True
        say("failed", error=traceback.format_exc())
        for info in cluster.workers:
            say("log-tail", worker=info.name, tail="\n" + cluster.log_tail(info, 40))
    finally:
        cluster.stop()
        copy_ray_logs(ray_logs or RAY_LOGS.resolve(), out / "logs" / "ray")  # a failed start: most likely ours
        say("cluster-stopped")
    workers = "one `both` worker" if args.deployment == "both" else "a prefill and a decode worker on one GPU"
    source = (f"measured in service by benchmarks/gpu_service_profile.py: {workers} ({' '.join(cfg.worker_args)}), "
              f"the step loop's turn per busy step; traces {', '.join(sorted({p.name for p in trace_of.values()}))}")
    served = "the tiny model on the CPU (smoke run)" if args.smoke else f"{Path(args.config).name}, random weights"
    try:
        fit = fit_profile(used, kernel, fit_grid(sizes), f"in service: {served}", source)
    except ValueError as error:
        say("fit-failed", error=str(error))
        record["fit_error"] = str(error)
        (out / "service-profile-run.json").write_text(json.dumps(record, indent=1) + "\n")
        return 1
    profile_path = out / "service-profile.json"
    profile_path.write_text(json.dumps(fit.profile, indent=1) + "\n")
    StepProfile.load(profile_path)
    rows = comparison(fit.profile, kernel)
    record.update(comparison=rows, missing=fit.missing, notes=fit.notes, profile=str(profile_path))
    (out / "service-profile-run.json").write_text(json.dumps(record, indent=1) + "\n")
    for line in fit.missing + fit.notes:
        say("fit-note", note=line)
    say("done", profile=str(profile_path), steps_used=len(used))
    print("\n" + table(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
