"""Expert-parallel decode: step time per rank for EP1 (one rank, every expert, no exchange) against EP R (R ranks,
each holding 1/R of the routed experts, tokens exchanged over NCCL at every MoE layer), with the exchange's share.

Every rank decodes its own batch (DP attention) at the given context, timed over iterations after a warm-up.
Eager steps (default) exchange split sizes (`--exchange splits`) or C rows per peer (`--exchange fixed`); the
exchange time is measured with device syncs around the collectives (`ExpertParallelMoE(sync_timing=True)`), which
the step time then includes too. `--graphs` (CUDA, flashinfer) replays each batch size's decode step from a CUDA
graph holding the fixed-capacity exchange, as the engine runs them (pdserve/engine/cuda_graphs.py: sequences grow a
token a step, each step's attention is planned while the previous one runs, and the host does not wait for the
device between steps); the exchange is then not timed apart. `--trace-dir` writes each rank's profiled steps as a
timeline and prints where its GPU sat idle (benchmarks/trace_gaps.py). Graph steps also report the host's own time a
step (the slowest rank's, waits for the device excluded): where it reaches the step time, the host sets the pace.
`--ep-one-rank` makes a one-rank instance still exchange (with itself), to check the path on one GPU.
`--prefill` times prefill steps instead (eager): each of a rank's `--batches` sequences computes its whole
`--context` in one step, and tokens/s counts those tokens.
`--redundant-experts N` keeps N replica slots a rank in each MoE layer and fills them from each case's warm-up load
(pdserve/engine/expert_rebalance.py), so that a skewed load is spread over its replicas.
`--router-skew` measures what an uneven expert load costs: each skew S scales every MoE layer's router rows of rank
0's experts (the first 1/R of them) by 1 + S, so those experts win the top-k more often, and reports the share of the
(token, expert) pairs they got, counted as the engine counts them (pdserve/ops/expert_load.py). The counts are
recorded at every skew, 0 included, as a worker records them.

`--variants` runs each EP size's steps several ways in one process (graphs captured afresh for each): `none` (the
shared experts after the exchange), `shared` (the shared experts while the tokens travel: the engine's default),
`no-transfer` (as `shared`, but every all-to-all is a local copy: the step's compute without the exchange, so
step - no-transfer step is the exchange's exposed time), `peer` (the fixed-capacity exchange by writes into the
peers' memory, pdserve/ops/peer_exchange.py, the shared experts after it; graphs only).

    python benchmarks/gpu_expert_parallel.py --ranks 1,2,4 --batches 64,256     # V2-Lite shape, 1..4 GPUs
    python benchmarks/gpu_expert_parallel.py --ranks 1,2 --batches 64,256 --graphs   # EP1 graph vs EP2 graph
    python benchmarks/gpu_expert_parallel.py --ranks 1,2 --batches 256 --graphs --variants none,shared,no-transfer
    python benchmarks/gpu_expert_parallel.py --ranks 2 --batches 64,256 --graphs --variants shared,peer,no-transfer
    python benchmarks/gpu_expert_parallel.py --ranks 2 --batches 256 --graphs --variants peer --router-skew 0,0.3,0.6
    python benchmarks/gpu_expert_parallel.py --ranks 1,2 --batches 8 --context 1024 --prefill --router-skew 0,0.4
    python benchmarks/gpu_expert_parallel.py --ranks 2 --batches 8 --context 1024 --prefill --router-skew 0,0.4 \
        --redundant-experts 8                          # rank 0's hottest experts replicated on rank 1
    python benchmarks/gpu_expert_parallel.py --device cpu --dtype float32 --layers 2 --ranks 1,2 --batches 2 \
        --context 32 --iters 2 --exchange fixed                                 # smoke run (gloo)
"""

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_decode_prefill import DEFAULT_CONFIG, contiguous_batch, step_inputs
from trace_gaps import summarize

from pdserve.http.ports import free_port
from pdserve.engine.cuda_graphs import DecodeGraphConfig, DecodeGraphs, leave_process_group
from pdserve.engine.expert_rebalance import ExpertRebalancer
from pdserve.model.compiled_layers import compile_layers, wants_compiled_layers
from pdserve.model.config import ModelConfig
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.attention import new_kv_pool
from pdserve.ops.expert_load import ExpertLoad
from pdserve.ops.moe import ExpertRange
from pdserve.ops.moe_ep import CompiledExpertParallelMoE, ExpertParallelMoE
from pdserve.ops.select import select_backends


PROFILED_STEPS = 3
# whether the shared experts run beside the exchange
VARIANTS = {"none": False, "shared": True, "no-transfer": True, "peer": False}


class LocalCopyExchange(ExpertParallelMoE):
    """The fixed-capacity exchange with each all-to-all replaced by a local copy: the same buffers, kernels and rows
    as a real exchange (received expert ids mapped onto this rank's experts, so its GEMMs get as many rows), and no
    transfer. Its step time is the step's compute alone."""

    def _all_to_all(self, out: torch.Tensor, tensor: torch.Tensor) -> "CopyDone":
        if tensor.dtype == torch.int64:  # expert ids: -1 stays padding, the rest land on this rank's experts
            tensor = torch.where(tensor >= 0, tensor % self.experts_per_rank + self.first_expert, tensor)
        out.copy_(tensor)
        return CopyDone()


class CopyDone:
    """A local copy's stand-in for a collective's Work: queued on the step's stream, nothing to wait for."""

    def wait(self) -> None:
        pass


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, results) -> None:
    on_cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if on_cuda else "cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # as a worker's rank runs (pdserve/worker/rank_actors.py)
    dtype = getattr(torch, args.dtype)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, device_id=device if on_cuda else None)
    try:
        raw = json.loads(Path(args.config).read_text())
        if args.layers:
            raw["num_hidden_layers"] = args.layers
        cfg = ModelConfig.from_dict(raw)
        backends = select_backends(args.attention, args.moe, device, dtype)
        backends = replace(backends, expert_load=ExpertLoad.zeros(cfg.num_hidden_layers, cfg.n_routed_experts,
                                                                  device))  # as the engine counts them
        experts, moe = None, None
        exchanges = world_size > 1 or args.ep_one_rank
        timed_exchange = not (args.graphs or args.untimed_exchange)  # device syncs around the collectives
        if exchanges:
            moe = ExpertParallelMoE(None, cfg.n_routed_experts, backends.moe, sync_timing=timed_exchange,
                                    capacity_factor=args.capacity_factor)
            experts = ExpertRange(moe.first_expert, moe.experts_per_rank)
            backends = replace(backends, moe=moe)
        model = init_random_weights(build_model(cfg, backends, device, dtype, experts), seed=rank)
        # as the engine decides: the layers' own work (and the exchange's) compiled into the graphs where it runs them
        compiled = compile_layers(model) if args.graphs and wants_compiled_layers(args.compile_layers, model) else None
        routers = [layer.mlp.gate.weight for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        unskewed = [weight.detach().clone() for weight in routers]
        hot = slice(0, cfg.n_routed_experts // world_size)  # rank 0's experts
        cases = [(b, v, s) for b in args.batches for v in (args.variants if exchanges else ["-"])
                 for s in args.router_skew]
        rebalancer = None
        for batch_size, variant, skew in cases:
            with torch.no_grad():
                for weight, base in zip(routers, unskewed):
                    weight.copy_(base)
                    weight[hot] *= 1 + skew
            if exchanges:
                moe = (LocalCopyExchange if variant == "no-transfer" else ExpertParallelMoE)(
                    None, cfg.n_routed_experts, backends.moe.local, sync_timing=timed_exchange,
                    capacity_factor=args.capacity_factor, overlap_shared=VARIANTS[variant])
                if variant == "peer":
                    moe.use_peer_writes(batch_size, cfg.num_experts_per_tok, cfg.hidden_size, dtype, device)
                model.backends = replace(backends, moe=moe)
                if compiled is not None:  # the same compiled work around this variant's exchange
                    compiled = replace(compiled, moe=CompiledExpertParallelMoE(moe, compiled.moe.work))
            # --prefill: each sequence's whole context computed in the step, else one new token on it
            kv_lens, query_lens = [args.context] * batch_size, [args.context if args.prefill else 1] * batch_size
            # graph steps grow every sequence by a token a step: pages for each step the script runs
            longest = args.context + (args.iters + PROFILED_STEPS + 2 if args.graphs else 0)
            num_pages = batch_size * -(-longest // args.page_size)
            # one page more: the graphs' scratch page for padding rows
            kv_cache = new_kv_pool(cfg.num_hidden_layers, num_pages + 1, args.page_size, cfg.kv_dim, dtype,
                                   device).normal_()
            ids, positions, last_rows = step_inputs(query_lens, kv_lens, cfg.vocab_size, device, seed=rank)
            fixed = moe is not None and args.exchange == "fixed"
            if fixed and not args.graphs:  # a graph holds its own
                moe.fixed_tokens = sum(query_lens)
            step = graph_step(model, kv_cache, num_pages, moe, ids, kv_lens, longest, args.page_size, compiled) \
                if args.graphs else eager_step(model, kv_cache, ids, positions, last_rows, query_lens, kv_lens,
                                               args.page_size)

            if exchanges and args.redundant_experts:
                rebalancer = rebalancer or ExpertRebalancer(model, moe, args.redundant_experts, interval_steps=1)
                rebalancer.rebalance()  # forgets the load of the cases before
            with torch.inference_mode():
                for _ in range(2):
                    step()
                if rebalancer is not None:  # replicas planned from this case's warm-up steps, as a worker's
                    rebalancer.rebalance()
                finish(device)
                dist.barrier()
                counts_before = backends.expert_load.counts.sum(0)
                exchange_before = moe.exchange.seconds if moe else 0.0
                host_before = step.host_busy_s() if args.graphs else 0.0
                started = time.perf_counter()
                for _ in range(args.iters):
                    step()
                finish(device)
                step_s = (time.perf_counter() - started) / args.iters
                exchange_s = ((moe.exchange.seconds if moe else 0.0) - exchange_before) / args.iters
                host_s = ((step.host_busy_s() if args.graphs else 0.0) - host_before) / args.iters
                overflowed = moe.overflowed_anywhere() if fixed else False
                pairs = backends.expert_load.counts.sum(0) - counts_before
                if args.profile or args.trace_dir:  # every rank steps (the exchange needs them all)
                    trace = Path(args.trace_dir) / f"ep{world_size}-batch{batch_size}-rank{rank}.json.gz" \
                        if args.trace_dir else None
                    _profile(step, f"EP{world_size} batch {batch_size}, rank 0" if rank == 0 and args.profile
                             else None, trace)
            results.put(dict(ranks=world_size, rank=rank, batch=batch_size, variant=variant, skew=skew,
                             pairs=pairs.tolist(), step_ms=step_s * 1e3,
                             exchange_ms=exchange_s * 1e3, host_ms=host_s * 1e3,
                             expert_gib=model.routed_expert_bytes() / 2**30, overflowed=overflowed))
            del kv_cache, step
            if on_cuda:
                torch.cuda.empty_cache()
    finally:
        leave_process_group()


def finish(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _profile(step, title: str | None, trace: Path | None, steps: int = PROFILED_STEPS) -> None:
    """The step's kernels by device time (the graph replay's too: CUPTI sees the kernels of a graph), so an EP step
    can be split into attention, expert GEMMs, exchange and the small kernels around them. `trace`: this rank's
    timeline is written there and its idle gaps printed (benchmarks/trace_gaps.py)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if title:
        print(f"\n{title}: {steps} steps\n" + prof.key_averages().table(sort_by="device_time_total", row_limit=18,
                                                                          max_name_column_width=60), flush=True)
    if trace:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        print(f"\n{steps} steps\n" + summarize(trace), flush=True)


def eager_step(model, kv_cache, ids, positions, last_rows, query_lens, kv_lens, page_size):
    device = kv_cache.device

    def step() -> None:
        batch = contiguous_batch(query_lens, kv_lens, page_size, device)
        model.compute_logits(model(ids, positions, kv_cache, batch)[last_rows])
        if device.type == "cuda":
            torch.cuda.synchronize()
    return step


def graph_step(model, kv_cache, scratch_page: int, moe: ExpertParallelMoE | None, ids, kv_lens, longest: int,
               page_size: int, compiled):
    """The batch's decode step replayed from a CUDA graph captured at exactly its size (the engine's DecodeGraphs,
    with the fixed-capacity exchange when `moe` is set), as the engine runs it: each step one token longer than the
    last, so the step's attention was planned while the previous one ran, and no wait for the device in between."""
    pages_per_seq = -(-longest // page_size)
    page_ids = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(len(kv_lens))]
    graphs = DecodeGraphs(model, kv_cache, page_size, DecodeGraphConfig((len(kv_lens),), pages_per_seq), scratch_page,
                          moe, compiled)
    host_ids, lens = ids.tolist(), list(kv_lens)

    def step() -> None:
        if max(lens) > longest:
            raise RuntimeError(f"more steps than the {longest - max(kv_lens)} the KV cache was sized for")
        slots = [pages[(n - 1) // page_size] * page_size + (n - 1) % page_size for pages, n in zip(page_ids, lens)]
        graphs.run(host_ids, [n - 1 for n in lens], slots, lens, page_ids)
        lens[:] = [n + 1 for n in lens]
    return GraphStep(step, graphs)


@dataclass
class GraphStep:
    """graph_step's step, timing the host: `host_busy_s` is its time in the steps so far less the waits for a replay
    before re-planning its capture (DecodeGraphs.device_wait_s). Where that is as long as the step, the host sets the
    pace. (A graph launch that blocks on a full device queue still counts as host time.)"""

    run: Callable[[], None]
    graphs: DecodeGraphs
    host_s: float = 0.0

    def __call__(self) -> None:
        started = time.perf_counter()
        self.run()
        self.host_s += time.perf_counter() - started

    def host_busy_s(self) -> float:
        return self.host_s - self.graphs.device_wait_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--moe", default="auto")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers (smoke runs)")
    parser.add_argument("--ranks", default="1,2,4", help="instance sizes to compare; each needs that many GPUs")
    parser.add_argument("--batches", default="64,256", help="decode batch per rank")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--exchange", choices=("splits", "fixed"), default="splits", help="eager steps' exchange")
    parser.add_argument("--capacity-factor", type=float, default=2.0, help="fixed exchange: C per peer, as a "
                                                                           "multiple of an even share")
    parser.add_argument("--graphs", action="store_true", help="replay decode from CUDA graphs (fixed exchange)")
    parser.add_argument("--compile-layers", choices=("auto", "on", "off"), default="auto",
                        help="graphs: the layers' compiled regions and experts, as the engine's --compile-layers")
    parser.add_argument("--ep-one-rank", action="store_true", help="a one-rank instance exchanges with itself")
    parser.add_argument("--untimed-exchange", action="store_true", help="eager steps: no device syncs around the "
                        "exchange (its time is then not measured, and the step is as the engine runs it)")
    parser.add_argument("--prefill", action="store_true", help="prefill steps instead of decode: each of a rank's "
                        "--batches sequences computes its whole --context (eager)")
    parser.add_argument("--variants", default="shared", help="exchanging instances: comma-separated of " +
                        ", ".join(VARIANTS) + " (see above)")
    parser.add_argument("--profile", action="store_true", help="rank 0 prints its kernels by device time")
    parser.add_argument("--trace-dir", help="each rank writes its profiled steps' timeline here and prints its idle "
                                            "gaps")
    parser.add_argument("--redundant-experts", type=int, default=0, help="exchanging instances: replica slots a "
                        "rank keeps in each MoE layer, filled from the load of each case's warm-up steps (split sizes "
                        "only: the fixed exchange keeps pairs with their owners)")
    parser.add_argument("--router-skew", default="0", help="comma-separated: rank 0's experts' router rows scaled "
                        "by 1 + S (an uneven expert load)")
    args = parser.parse_args()
    args.router_skew = [float(s) for s in args.router_skew.split(",")]
    if args.graphs and args.prefill:
        parser.error("--prefill runs eager steps (the engine's prefill steps under EP are eager): drop --graphs")
    if args.graphs:
        if args.device != "cuda":
            parser.error("--graphs needs --device cuda (flashinfer attention)")
        args.exchange = "fixed"
    args.batches = [int(b) for b in args.batches.split(",")]
    args.variants = args.variants.split(",")
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    if args.redundant_experts and (args.graphs or args.exchange == "fixed"):
        parser.error("--redundant-experts: replicas serve the exchange with split sizes (no --graphs, --exchange "
                     "splits)")
    if {"no-transfer", "peer"} & set(args.variants) and not args.graphs:
        parser.error("the no-transfer and peer variants replace the fixed-capacity exchange: they need --graphs")
    available = torch.cuda.device_count() if args.device == "cuda" else 64
    sizes = [r for r in (int(r) for r in args.ranks.split(",")) if r <= available]

    ctx = mp.get_context("spawn")
    rows = []
    for world_size in sizes:
        print(f"EP{world_size}: starting {world_size} rank(s) ...", flush=True)
        results = ctx.Queue()
        mp.start_processes(_rank_main, args=(world_size, free_port(), args, results), nprocs=world_size,
                           start_method="spawn", join=True)
        variants = args.variants if world_size > 1 or args.ep_one_rank else ["-"]
        cases = [(b, v, s) for b in args.batches for v in variants for s in args.router_skew]
        per_rank = [results.get(timeout=60) for _ in range(world_size * len(cases))]
        for batch, variant, skew in cases:
            ranks = [r for r in per_rank if (r["batch"], r["variant"], r["skew"]) == (batch, variant, skew)]
            pairs = torch.tensor([r["pairs"] for r in ranks]).sum(0)
            rows.append(dict(ranks=world_size, batch=batch, variant=variant, skew=skew,
                             hot_share=(pairs[: len(pairs) // world_size].sum() / pairs.sum()).item(),
                             step_ms=max(r["step_ms"] for r in ranks), exchange_ms=max(r["exchange_ms"] for r in ranks),
                             host_ms=max(r["host_ms"] for r in ranks), expert_gib=ranks[0]["expert_gib"]))
            # at once: a later instance size that hangs or runs out of time must not take these figures with it
            print(f"EP{world_size} batch {batch} {variant} skew {skew}: step {rows[-1]['step_ms']:.2f} ms, exchange "
                  f"{rows[-1]['exchange_ms']:.2f} ms, rank 0's experts took {rows[-1]['hot_share']:.1%} of the pairs",
                  flush=True)
            if any(r["overflowed"] for r in ranks):
                print(f"EP{world_size} batch {batch}: the fixed exchange overflowed (some figures are of dropped "
                      "pairs); raise --capacity-factor", flush=True)
    skipped = sorted(set(int(r) for r in args.ranks.split(",")) - set(sizes))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    kind = "CUDA-graph" if args.graphs else "eager"
    phase = "prefill" if args.prefill else "decode"
    print(f"\n{device_name}; context {args.context}; {args.dtype}; step = slowest rank's {kind} {phase} step; "
          f"exchange: {args.exchange}" + (f"; skipped (not enough devices): {skipped}" if skipped else "")
          + (f"; {args.redundant_experts} replica slots a rank and MoE layer" if args.redundant_experts else ""))
    print("| ranks | batch per rank | overlap | router skew | rank 0's experts' share of pairs | step (ms) | host (ms) "
          "| exchange (ms) | exchange share | tokens/s (all ranks) | expert weights per rank (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        tokens_per_s = row["ranks"] * row["batch"] * (args.context if args.prefill else 1) / (row["step_ms"] / 1e3)
        exchange_ms = row["exchange_ms"] if not (args.graphs or args.untimed_exchange) else _exposed_ms(row, rows)
        exchange = "- | -" if exchange_ms is None else f"{exchange_ms:.2f} | {exchange_ms / row['step_ms']:.0%}"
        host = f"{row['host_ms']:.2f}" if args.graphs else "-"
        print(f"| {row['ranks']} | {row['batch']} | {row['variant']} | {row['skew']:g} | {row['hot_share']:.1%} | "
              f"{row['step_ms']:.2f} | {host} | {exchange} | "
              f"{tokens_per_s:,.0f} | {row['expert_gib']:.2f} |")


def _exposed_ms(row: dict, rows: list[dict]) -> float | None:
    """Graph steps: the exchange's exposed time, the step less the same step with no transfer (when run)."""
    base = [r for r in rows if (r["ranks"], r["batch"], r["variant"], r["skew"]) ==
            (row["ranks"], row["batch"], "no-transfer", row["skew"])]
    return row["step_ms"] - base[0]["step_ms"] if base and row["variant"] not in ("-", "no-transfer") else None


if __name__ == "__main__":
    main()
