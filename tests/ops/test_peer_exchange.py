"""Writes into peer memory (two GPUs of one host) against NCCL's equal-split all_to_all_single: the same bytes,
eagerly and replayed from a CUDA graph on new data; the expert-parallel layer on peer writes against it on NCCL."""

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import run_spawned_ranks

from pdserve.engine.cuda_graphs import leave_process_group
from pdserve.http.ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

WORLD_SIZE, ROWS_PER_PEER, HIDDEN = 2, 48, 512


def _needs_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs")


def _join(rank: int, port: int) -> torch.device:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            device_id=device)
    return device


def _nccl_all_to_all(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor)
    return out


def _exchange_rank(rank: int, port: int, results) -> None:
    from pdserve.ops.peer_exchange import PeerExchange, region_bytes_for

    device = _join(rank, port)
    try:
        rows = WORLD_SIZE * ROWS_PER_PEER
        exchange = PeerExchange(None, (region_bytes_for(rows, (HIDDEN * 2, 8)), region_bytes_for(rows, (HIDDEN * 2,))),
                                device)
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = torch.randint(-1, 64, (rows,), device="cuda", generator=gen)
        half = x[: rows // 2].contiguous()
        got_x, got_ids = (t.clone() for t in exchange.all_to_all(0, (x, ids)))
        got_back = exchange.all_to_all(1, (half,), spare_rows=1)[0].clone()
        eager_ok = (torch.equal(got_x, _nccl_all_to_all(x)) and torch.equal(got_ids, _nccl_all_to_all(ids))
                    and got_back.shape[0] == rows // 2 + 1 and torch.equal(got_back[:-1], _nccl_all_to_all(half)))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            exchange.all_to_all(0, (x, ids))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed_x, replayed_ids = exchange.all_to_all(0, (x, ids))
        x.normal_(generator=gen)
        ids.random_(0, 64, generator=gen)
        graph.replay()
        torch.cuda.synchronize()
        graph_ok = torch.equal(replayed_x, _nccl_all_to_all(x)) and torch.equal(replayed_ids, _nccl_all_to_all(ids))
        fits = exchange.fits(0, (x, ids)) and not exchange.fits(0, (torch.cat([x, x]), ids))
        results.put((rank, eager_ok, graph_ok, fits))
        del graph
    finally:
        leave_process_group()


def test_peer_writes_move_what_nccl_all_to_all_moves_eagerly_and_in_a_graph():
    _needs_two_gpus()
    port = free_port()
    got = run_spawned_ranks(_exchange_rank, [(r, port) for r in range(WORLD_SIZE)], 240)
    assert got == {r: [True, True, True] for r in range(WORLD_SIZE)}


def _moe_rank(rank: int, port: int, results) -> None:
    from pdserve.ops.moe_ep import ExpertParallelMoE, expert_owner_range
    from pdserve.ops.moe_grouped import GroupedMoE

    _join(rank, port)
    try:
        experts, hidden, inter, top_k, tokens = 16, 256, 128, 4, 64
        gen = torch.Generator().manual_seed(11)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).cuda().bfloat16()
        w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).cuda().bfloat16()
        gen.manual_seed(100 + rank)
        x = torch.randn(tokens, hidden, generator=gen).cuda().bfloat16()
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).cuda()
        weights = torch.rand(tokens, top_k, generator=gen).cuda()
        first, count = expert_owner_range(rank, WORLD_SIZE, experts)
        outs = []
        for peer_writes in (False, True):
            exchange = ExpertParallelMoE(None, experts, GroupedMoE(), capacity_factor=0.75)  # some pairs overflow C
            exchange.fixed_tokens = tokens
            if peer_writes:
                exchange.use_peer_writes(tokens, top_k, hidden, torch.bfloat16, torch.device("cuda", rank))
            outs.append(exchange.forward(x, ids, weights, w13[first:first + count], w2[first:first + count], first))
            outs.append(exchange.exchange.peer_calls)
            outs.append(exchange.overflowed_anywhere())
        results.put((rank, torch.equal(outs[0], outs[3]), outs[1:3], outs[4:6]))
    finally:
        leave_process_group()


def test_expert_parallel_layer_on_peer_writes_equals_it_on_nccl():
    """Same rows, same kernels: bit-identical, with pairs dropped past C alike (and the overflow seen alike)."""
    _needs_two_gpus()
    port = free_port()
    got = run_spawned_ranks(_moe_rank, [(r, port) for r in range(WORLD_SIZE)], 240)
    assert got == {r: [True, [0, True], [1, True]] for r in range(WORLD_SIZE)}

