"""Expert-parallel engines in lockstep (gloo, 2 and 4 processes) generate exactly what one engine with every expert does."""

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import run_spawned_ranks

from pdserve.http.ports import free_port
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import leave_process_group
from pdserve.engine.engine import Engine
from pdserve.engine.llm import LLM
from pdserve.engine.lockstep import Lockstep
from pdserve.model.config import ModelConfig
from pdserve.ops.moe import ExpertRange
from pdserve.ops.moe_ep import ExpertParallelMoE, expert_owner_range
from pdserve.wire.sampling import SamplingParams

SAMPLING = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts_for(world_size: int) -> list[list[list[int]]]:
    """Uneven load: rank r gets r+1 prompts of different lengths, except the last rank of 4, which stays idle."""
    gen = torch.Generator().manual_seed(3)
    per_rank = []
    for rank in range(world_size):
        count = 0 if world_size == 4 and rank == world_size - 1 else rank + 1
        per_rank.append([torch.randint(3, 200, (5 + 7 * i + rank,), generator=gen).tolist() for i in range(count)])
    return per_rank


def _rank_main(rank: int, world_size: int, port: int, model: str, prompts: list[list[int]],
               runs: list[tuple[dict, float]], results) -> None:
    """One rank: an engine per run of `runs` ((EngineConfig fields, capacity factor)), one after the other in this
    process (a spawn of ranks costs seconds of imports), over gloo on the CPU, NCCL on GPU `rank`."""
    on_cuda = runs[0][0]["device"] == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        results.put((rank, [_run_rank(rank, world_size, model, prompts, options, capacity_factor)
                            for options, capacity_factor in runs]))
    finally:
        leave_process_group()  # the engines (and their graphs) went with _run_rank's frames


def _run_rank(rank: int, world_size: int, model: str, prompts: list[list[int]], options: dict,
              capacity_factor: float) -> tuple:
    num_experts = ModelConfig.from_dir(model).n_routed_experts
    experts = ExpertRange(*expert_owner_range(rank, world_size, num_experts))
    backends: list[ExpertParallelMoE] = []
    host_group = dist.new_group(backend="gloo")  # as a worker's ranks agree on host values (rank_runtime.py)

    def wrap(local):
        backends.append(ExpertParallelMoE(None, num_experts, local, capacity_factor=capacity_factor,
                                          host_group=host_group))
        return backends[-1]

    engine = Engine(EngineConfig(model=model, progress=False, **options), experts=experts, wrap_moe=wrap)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{rank}-{i}", ids, SAMPLING)
    tokens: dict[str, list[int]] = {f"r{rank}-{i}": [] for i in range(len(prompts))}
    lockstep, steps = Lockstep(host_group, torch.device("cpu")), 0
    while lockstep.any_rank_busy(engine.has_work()) and steps < 100:
        steps += 1
        for out in engine.step(force_forward=True):
            tokens[out.request_id].extend(out.new_token_ids)
    stats = engine.stats()
    return ([tokens[f"r{rank}-{i}"] for i in range(len(prompts))], steps, stats.expert_weight_bytes,
            backends[0].exchange, stats.expert_replica_slots_filled)


def run_instance(model: str, per_rank: list[list[list[int]]], runs: list[tuple[dict, float]],
                 timeout_s: float = 90) -> dict:
    """{rank: [(tokens per prompt, forward passes, expert bytes, exchange stats) for each run]}."""
    port = free_port()
    got = run_spawned_ranks(_rank_main, [(r, len(per_rank), port, model, prompts, runs)
                                         for r, prompts in enumerate(per_rank)], timeout_s)
    return {rank: rest[0] for rank, rest in got.items()}


def one_engine(model: str, per_rank: list[list[list[int]]], options: dict) -> tuple[list[list[int]], int]:
    """One engine with every expert: every rank's prompts' greedy tokens, in rank order, and its expert bytes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: BLAS results may depend on the thread count
    try:
        llm = LLM(model, progress=False, **options)
        flat = [ids for prompts in per_rank for ids in prompts]
        return ([r.token_ids for r in llm.generate(prompt_token_ids=flat, sampling=SAMPLING)],
                llm.engine.stats().expert_weight_bytes)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("arch", "world_size", "fixed_capacity_factor"), [
    ("v2", 2, 2.0),  # C holds every pair: decode steps never overflow
    ("v3", 4, 0.5),  # C is half an even share: steps overflow and run again with split sizes
])
def test_expert_parallel_greedy_tokens_equal_one_rank_with_all_experts(tiny_model_factory, arch, world_size,
                                                                       fixed_capacity_factor):
    """Both exchanges, one after the other in the same ranks: split sizes throughout, then fixed capacity."""
    model = tiny_model_factory(arch)
    per_rank = prompts_for(world_size)
    options = dict(dtype="float32", device="cpu", num_pages=64)
    expected, all_expert_bytes = one_engine(model, per_rank, options)
    # the third: split sizes with a replica slot a rank, re-planned from the load after every step
    exchanges = [("splits", 2.0), ("fixed", fixed_capacity_factor), ("splits", 2.0)]
    replicas = dict(redundant_experts=1, expert_rebalance_steps=1)
    got = run_instance(model, per_rank, [(options | dict(expert_exchange=exchange) | (replicas if run == 2 else {}),
                                          capacity_factor)
                                         for run, (exchange, capacity_factor) in enumerate(exchanges)], timeout_s=150)
    for run, (exchange, capacity_factor) in enumerate(exchanges):
        steps = {got[rank][run][1] for rank in got}
        assert len(steps) == 1, f"{exchange}: ranks ran different numbers of forward passes: {steps}"
        expected_tokens = iter(expected)
        for rank, prompts in enumerate(per_rank):
            tokens, _, expert_bytes, stats, replica_slots_filled = got[rank][run]
            assert tokens == [next(expected_tokens) for _ in prompts], f"run {run} ({exchange}): rank {rank}"
            assert expert_bytes * world_size == all_expert_bytes
            assert (stats.fixed_calls > 0) == (exchange == "fixed")
            assert (stats.overflow_steps > 0) == (capacity_factor < 1), stats  # every rank counts agreed overflows
            assert (replica_slots_filled > 0) == (run == 2)  # the uneven prompts load some experts more


@pytest.mark.timeout(180)
def test_replicated_fp8_experts_give_the_tokens_of_one_rank(tiny_model_factory):
    """Kept FP8 experts (values and scale grids) replicated on the other rank, re-planned after every step."""
    model = tiny_model_factory("v3", fp8=True, hidden_size=160, intermediate_size=300, moe_intermediate_size=128)
    per_rank = prompts_for(2)
    options = dict(dtype="float32", device="cpu", num_pages=64, fp8_weights="keep")
    expected, _ = one_engine(model, per_rank, options)
    got = run_instance(model, per_rank, [(options | dict(expert_exchange="splits", redundant_experts=1,
                                                         expert_rebalance_steps=1), 2.0)], timeout_s=150)
    assert [tokens for rank in sorted(got) for tokens in got[rank][0][0]] == expected
    assert all(got[rank][0][4] > 0 for rank in got)  # replica slots were filled


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2])
def test_expert_parallel_decode_under_cuda_graphs_gives_the_eager_tokens(tiny_model_factory, world_size):
    """NCCL, bf16, flashinfer: decode replays graphs holding the fixed-capacity exchange (an idle rank replays padding
    rows) and gives the tokens of eager steps exchanging split sizes. Two ranks on one host exchange by writes into
    each other's memory (expert_peer_writes auto)."""
    pytest.importorskip("flashinfer", reason="decode graphs run on the flashinfer attention backend")
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    model = tiny_model_factory("v2", kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16,
                               num_key_value_heads=16, qk_nope_head_dim=128, v_head_dim=128)
    # Rank 1 (of 2) has nothing to do: it joins every exchange, replaying graphs of padding rows in decode steps.
    per_rank = [prompts_for(2)[1], []][:world_size]
    options = dict(device="cuda", dtype="bfloat16", num_pages=64, max_num_seqs=4)
    graphs = {rank: runs[0] for rank, runs in
              run_instance(model, per_rank, [(options | dict(expert_exchange="auto"), 2.0)], 300).items()}
    eager = {rank: runs[0] for rank, runs in
             run_instance(model, per_rank, [(options | dict(expert_exchange="splits"), 2.0)], 300).items()}
    for rank in range(world_size):
        assert graphs[rank][0] == eager[rank][0], f"rank {rank}"
        assert graphs[rank][3].fixed_calls > 0 and eager[rank][3].fixed_calls == 0
        assert (graphs[rank][3].peer_calls > 0) == (world_size > 1)
