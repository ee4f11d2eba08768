"""Expert parallelism: routed experts sharded over a torch.distributed group, tokens sent to their experts' owners.

Rank r holds experts [r * E/R, (r+1) * E/R). Each MoE layer does three all-to-alls: split sizes, then the dispatch (a
token's row, expert ids and routing weights packed in one row of bytes), then the owners' sums back (combine). A token
goes once to each rank that owns some of its experts, however many of them it owns (at prefill sizes the exchange's
bytes are what EP pays). The owner runs its received rows through the rank's own MoE backend (grouped GEMM on the GPU,
TorchMoE on the CPU), where the ids of other ranks' experts add nothing, and returns each row's weighted sum. The
origin adds a token's sums in rank order: one rank's result up to float rounding (the order of the additions differs).
Every rank must call forward the same number of times (an empty batch still joins each collective). With a layer's
`placement` (pdserve/ops/expert_placement.py) a replicated expert's pairs are spread over the ranks holding it, and
each row carries, for the rank it goes to, that rank's slots of the pairs it computes (-1 for the others).

Decode steps can use a fixed-capacity exchange instead (`fixed_tokens` set, the same on every rank): each rank
reserves C rows for each peer, one row per (token, expert) pair, the all-to-alls move equal splits, and nothing waits
on the host, so the step can be captured in a CUDA graph. The origin sums each token's experts in ascending expert id,
TorchMoE's order, so float32 results equal one rank holding all. A pair past its owner's C rows is dropped and raises
the overflow flag; the engine then runs the step again with split sizes (`overflowed_anywhere`), so no result ever
comes from a dropped pair.

Between the GPUs of one host the fixed-capacity exchange can instead write each peer's rows straight into its memory
(`use_peer_writes`, pdserve/ops/peer_exchange.py): the same rows, moved faster than NCCL's all_to_all_single.

Overlap: the dispatch is launched without waiting, and work that does not need it runs while the tokens travel: the
layer's shared experts (`beside`). Two-batch overlap (half the tokens through their experts while the other half
travel) was measured slower at decode sizes, where the experts' weights would be read twice (docs/expert_parallel.md).
"""

import functools
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.ops.expert_placement import LayerPlacement
from pdserve.ops.moe import MoEBackend, TorchMoE
from pdserve.ops.moe_grouped import GroupedMoE, sum_slot_rows
from pdserve.ops.peer_exchange import PeerExchange, region_bytes_for
from pdserve.ops.token_dynamic import compile_token_dynamic

log = logging.getLogger(__name__)

ROW_ALIGN_BYTES = 128  # a packed dispatch row's length (pack_rows): each row's values start 128-byte aligned


@dataclass
class ExchangeStats:
    """Time and volume spent in the dispatch/combine collectives (cumulative)."""

    calls: int = 0
    seconds: float = 0.0
    # rows sent: (token, owner) rows with split sizes, (token, expert) pairs in the fixed-capacity exchange (its
    # padding rows not counted)
    sent_rows: int = 0
    fixed_calls: int = 0  # of `calls`, those through the fixed-capacity exchange
    peer_calls: int = 0  # of `fixed_calls`, those by writes into peer memory
    overflow_steps: int = 0  # fixed-capacity steps some rank overflowed, run again with split sizes


def expert_owner_range(rank: int, world_size: int, num_experts: int) -> tuple[int, int]:
    """[first, first + count) of the experts `rank` holds."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} routed experts do not split evenly over {world_size} ranks")
    count = num_experts // world_size
    return rank * count, count


def capacity_rows(tokens: int, top_k: int, world_size: int, factor: float) -> int:
    """Rows a rank reserves for each peer when every rank sends at most `tokens` tokens: `factor` times an even share
    of their (token, expert) pairs, and never more than all of them (at that size no pair can overflow)."""
    pairs = tokens * top_k
    return min(pairs, math.ceil(factor * pairs / world_size))


@dataclass(frozen=True)
class FixedExchangeWork:
    """The fixed-capacity exchange's tensor work around its collectives: placing the pairs in the send buffers, the
    owner's experts, and putting the returned rows back together. Eager, or compiled for the decode graphs (each is
    ~20 small kernels a layer eagerly)."""

    place: Callable  # place_pairs
    owned: Callable  # owned_rows over the rank's local backend
    combine: Callable  # combine_returned


class ExpertParallelMoE:
    """MoEBackend over `group`; `local` computes this rank's experts; `sync_timing` waits for the device around the
    exchange so its time is exact; `capacity_factor` sizes the fixed-capacity exchange (capacity_rows)."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, local: MoEBackend | None = None,
                 sync_timing: bool = False, capacity_factor: float = 2.0, host_group: dist.ProcessGroup | None = None,
                 overlap_shared: bool = True):
        """`host_group`: a gloo group of the same ranks for agreeing on host values (a step's size); over NCCL the
        agreement would wait for all the device work queued before it, so the host could not run a step ahead.
        `overlap_shared`: the model runs its shared experts while the tokens travel (see forward's `beside`)."""
        self.group = group
        self.host_group = host_group
        self.local = local or TorchMoE()
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.first_expert, self.experts_per_rank = expert_owner_range(self.rank, self.world_size, num_experts)
        self.sync_timing = sync_timing
        self.capacity_factor = capacity_factor
        self.overlap_shared = overlap_shared
        self.exchange = ExchangeStats()
        # Tokens per rank of the current fixed-capacity step (every rank alike), or None: split sizes exchanged.
        self.fixed_tokens: int | None = None
        self._overflow: torch.Tensor | None = None  # one persistent flag on the device, raised in place (graph-safe)
        self.eager_work = FixedExchangeWork(place_pairs, functools.partial(owned_rows, self.local), combine_returned)
        self.peer: PeerExchange | None = None  # set by use_peer_writes

    def peer_writes_possible(self) -> bool:
        """A collective: whether the ranks can write into each other's memory: all on one host (by host name), on
        distinct GPUs (by UUID: under Ray each rank sees only its own GPU, as device 0), each with peer access to the
        other GPUs it sees (some PCIe hosts have none: NCCL stages through the host there)."""
        device, count = torch.cuda.current_device(), torch.cuda.device_count()
        reaches_all = all(torch.cuda.can_device_access_peer(device, other) for other in range(count) if other != device)
        mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid), reaches_all)
        everyone: list[tuple | None] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.host_group or self.group)
        hosts, gpus, reach = zip(*everyone)  # type: ignore[misc]
        return len(set(hosts)) == 1 and len(set(gpus)) == self.world_size and all(reach)

    def use_peer_writes(self, max_tokens: int, top_k: int, hidden: int, dtype: torch.dtype,
                        device: torch.device) -> bool:
        """Fixed-capacity steps of up to `max_tokens` tokens a rank (`hidden`-wide rows of `dtype`) exchange by
        writes into the peers' memory instead of NCCL (larger ones still use NCCL). A collective: every rank maps
        every other's buffer. Where any rank could not (ranks that each see one GPU cannot ask whether the others'
        are in reach), every rank stays on NCCL; returns whether they write into peer memory."""
        rows = self.world_size * capacity_rows(max_tokens, top_k, self.world_size, self.capacity_factor)
        row_bytes = hidden * dtype.itemsize
        try:
            peer: PeerExchange | None = PeerExchange(
                self.group, (region_bytes_for(rows, (row_bytes, torch.int64.itemsize)),
                             region_bytes_for(rows, (row_bytes,))), device)
        except RuntimeError as error:
            log.warning("rank %d cannot map its peers' memory (%s); the expert exchange stays on NCCL",
                        self.rank, error)
            peer = None
        (failed,) = self._host_max([int(peer is None)])
        self.peer = None if failed else peer
        return self.peer is not None

    def agree_fixed_tokens(self, tokens: int | None) -> int | None:
        """A collective: every rank offers its decode step's token count, or None where its step needs the exchange
        with split sizes (a prefill chunk, a batch larger than any graph). The most tokens of any rank, or None if
        any rank said None."""
        needs_splits, most = self._host_max([int(tokens is None), tokens or 0])
        return None if needs_splits else most

    def _host_max(self, values: list[int]) -> list[int]:
        """A collective: the element-wise maximum of every rank's `values`, over the host group where there is one."""
        on_host = self.host_group is not None
        offer = torch.tensor(values, dtype=torch.int64, device=torch.device("cpu") if on_host else self._device())
        dist.all_reduce(offer, op=dist.ReduceOp.MAX, group=self.host_group if on_host else self.group)
        return offer.tolist()

    def may_overflow(self, tokens: int, top_k: int) -> bool:
        return capacity_rows(tokens, top_k, self.world_size, self.capacity_factor) < tokens * top_k

    @torch.inference_mode()  # the flag was made in the forward pass, under inference mode
    def overflowed_anywhere(self) -> bool:
        """A collective: whether any rank's fixed-capacity exchange dropped a pair since the last call (then the step
        must run again with split sizes, on every rank). Clears the flag."""
        flag = self._overflow_flag(self._device()).to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self._overflow.zero_()
        overflowed = bool(flag.item())
        self.exchange.overflow_steps += overflowed
        return overflowed

    def _device(self) -> torch.device:
        # gloo reduces CPU tensors, NCCL device tensors
        return torch.device("cuda") if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _overflow_flag(self, device: torch.device) -> torch.Tensor:
        if self._overflow is None:
            self._overflow = torch.zeros(1, dtype=torch.bool, device=device)
        return self._overflow

    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int,
                work: FixedExchangeWork | None = None, beside: Callable[[], torch.Tensor] | None = None,
                placement: LayerPlacement | None = None):
        """`work`: the fixed-capacity exchange's tensor work (CompiledExpertParallelMoE's compiled); eager without.
        `beside`: work of the same tokens that needs no expert output (the layer's shared experts), run while the
        tokens travel; its result is added to the routed sum. `placement`: the layer's replicated experts, which
        the exchange with split sizes spreads pairs over (the fixed-capacity exchange keeps pairs with owners)."""
        if first_expert != self.first_expert or w13.shape[0] != self.experts_per_rank:
            raise ValueError(
                f"rank {self.rank} should hold experts [{self.first_expert}, +{self.experts_per_rank}), "
                f"the model holds [{first_expert}, +{w13.shape[0]})"
            )
        if self.fixed_tokens is not None:
            routed, beside_out = self._exchange_fixed(x, topk_ids, topk_weights, w13, w2, work or self.eager_work,
                                                      beside)
        else:
            routed, beside_out = self._exchange_splits(x, topk_ids, topk_weights, w13, w2, beside, placement)
        return routed if beside_out is None else routed + beside_out

    def _exchange_splits(self, x, topk_ids, topk_weights, w13, w2, beside, placement: LayerPlacement | None):
        """Split sizes first (the host reads them), then one row per (token, rank computing some of its experts),
        with the token's expert ids and routing weights. Each owner returns its experts' weighted sum for the row; the
        origin adds a token's sums in rank order. Returns the routed sum and `beside`'s result."""
        num_tokens, k = topk_ids.shape
        if placement is None:
            owner = torch.div(topk_ids, self.experts_per_rank, rounding_mode="floor")
            first_expert = self.first_expert
        else:  # each pair's rank; the rows then carry, for their owner, its slots of the pairs it computes
            owner = placement.pair_ranks(topk_ids)
            (w13, w2), first_expert = placement.weights, 0
        owners = torch.zeros(num_tokens, self.world_size, dtype=torch.bool, device=x.device).scatter_(1, owner, True)
        # (owner, token) cells that send a row first, grouped by owner, tokens in order inside a group. The host reads
        # one thing a layer, the split sizes below: each read waits for the device.
        cells = torch.argsort((~owners.T).reshape(-1).to(torch.uint8), stable=True)
        # (rows, expert slots) sent to each owner: the owner computes only its own slots of the rows it gets
        send_counts = torch.stack([owners.sum(dim=0), owner_slots(owner, self.world_size)], dim=1)

        beside_out = self._beside_untimed(beside)
        started = self._clock()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts_copy = torch.cat([send_counts, recv_counts]).to("cpu", non_blocking=True)
        copied = torch.cuda.Event() if x.is_cuda else None
        if copied is not None:
            copied.record()
        # Work that needs no split size, queued behind the copy: the device runs it while the host waits for the
        # counts, and the host's launches after the read find work still running.
        per_token = pack_rows(x, topk_ids, topk_weights)
        cell_owner = torch.div(cells, max(num_tokens, 1), rounding_mode="floor")
        cell_token = cells % max(num_tokens, 1)
        if copied is not None:
            copied.synchronize()
        counts = counts_copy.tolist()
        send_split = [rows for rows, _ in counts[:self.world_size]]
        recv_split = [rows for rows, _ in counts[self.world_size:]]
        received = sum(recv_split)
        row_owner, row_token = cell_owner[:sum(send_split)], cell_token[:sum(send_split)]
        send = per_token[row_token]
        if placement is not None:
            sent_ids = unpack_rows(send, x.shape[1], x.dtype, k)[1]
            sent_ids.copy_(placement.slots_at(row_owner, sent_ids, owner[row_token]))
        recv = send.new_empty(received, send.shape[1])
        in_flight = [dist.all_to_all_single(recv, send, recv_split, send_split, group=self.group, async_op=True)]
        if beside is not None and beside_out is None:
            beside_out = beside()
        _wait(in_flight)
        dispatched = self._clock()

        # The ids this rank does not hold add nothing: each row comes back as its local experts' weighted sum.
        local_slots = sum(slots for _, slots in counts[self.world_size:])
        expert_out = owned_row_sums(self.local, *unpack_rows(recv, x.shape[1], x.dtype, k), w13, w2,
                                    first_expert, local_slots) if received else x[:0]  # no empty grouped GEMM

        combine_started = self._clock()
        back = x.new_empty(send.shape[0], x.shape[1])
        dist.all_to_all_single(back, expert_out.to(x.dtype), send_split, recv_split, group=self.group)
        self._count(started, dispatched, combine_started, int(send.shape[0]))

        # Each token's returned rows added in rank order, read where they arrived: slot s of a token (its s-th owner;
        # it has at most min(k, R)) names the row of `back` that owner returned, -1 past its last owner.
        slots = min(k, self.world_size)
        slot = (torch.cumsum(owners, dim=1) - 1)[row_token, row_owner]
        slot_row = row_token.new_full((num_tokens * slots,), -1)
        slot_row[row_token * slots + slot] = torch.arange(row_token.shape[0], device=x.device)
        return sum_slot_rows(back, slot_row, slots), beside_out

    def _exchange_fixed(self, x, topk_ids, topk_weights, w13, w2, work: FixedExchangeWork, beside):
        """C rows per (rank, peer), padding marked by expert id -1; no host reads, so a graph can hold it. Pairs
        past their owner's C rows are dropped (their output reads as zero) and raise the overflow flag. Returns the
        routed sum and `beside`'s result."""
        num_pairs = topk_ids.numel()
        k = topk_ids.shape[1]
        if num_pairs > self.fixed_tokens * k:
            raise ValueError(f"{num_pairs // k} tokens in a fixed-capacity step of {self.fixed_tokens}")
        capacity = capacity_rows(self.fixed_tokens, k, self.world_size, self.capacity_factor)
        rows = self.world_size * capacity
        send_x, send_ids, order, slot, overflowed = work.place(x, topk_ids, self.experts_per_rank, self.world_size,
                                                               capacity)
        self._overflow_flag(x.device).logical_or_(overflowed)

        beside_out = self._beside_untimed(beside)
        # Peer writes where this step's rows fit the buffers (every rank decides alike: the same fixed_tokens)
        peer = self.peer if self.peer is not None and self.peer.fits(0, (send_x, send_ids)) else None
        started = self._clock()
        if peer is not None:  # in the step's stream: work beside it runs after it
            recv_x, recv_ids = peer.all_to_all(0, (send_x, send_ids))
        else:
            recv_x, recv_ids = torch.empty_like(send_x), torch.empty_like(send_ids)
            in_flight = [self._all_to_all(recv_x, send_x), self._all_to_all(recv_ids, send_ids)]
        if beside is not None and beside_out is None:
            beside_out = beside()
        if peer is None:
            _wait(in_flight)
        dispatched = self._clock()

        # Padding rows carry expert -1, which no rank holds: the local backend leaves them out (they return unset
        # rows, which no pair reads). Every owner receives k rows a token on average.
        expert_out = work.owned(recv_x, recv_ids, w13, w2, self.first_expert, self.world_size,
                                self.fixed_tokens * k)

        combine_started = self._clock()
        # a spare row past the returned ones, which dropped pairs read (as zero: combine_returned selects it out)
        if peer is not None and peer.fits(1, (expert_out,), spare_rows=1):
            back = peer.all_to_all(1, (expert_out,), spare_rows=1)[0]
        else:
            back = x.new_empty(rows + 1, x.shape[1])
            _wait([self._all_to_all(back[:rows], expert_out)])
        self._count(started, dispatched, combine_started, num_pairs)
        self.exchange.fixed_calls += 1
        self.exchange.peer_calls += peer is not None
        return work.combine(back, order, slot, topk_ids, topk_weights), beside_out

    def _all_to_all(self, out: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
        """One equal-split all-to-all of the fixed-capacity exchange, launched without waiting for it. (The
        expert-parallel benchmark replaces it to time steps with no transfer.)"""
        return dist.all_to_all_single(out, tensor, group=self.group, async_op=True)

    def _beside_untimed(self, beside: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
        """With sync_timing the exchange is timed alone, so `beside` runs before it instead of during it."""
        return beside() if beside is not None and self.sync_timing else None

    def _count(self, started: float, dispatched: float, combine_started: float, sent_rows: int) -> None:
        finished = self._clock()
        self.exchange.calls += 1
        self.exchange.seconds += (dispatched - started) + (finished - combine_started)
        self.exchange.sent_rows += sent_rows

    def _clock(self) -> float:
        if self.sync_timing and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def place_pairs(x: torch.Tensor, topk_ids: torch.Tensor, experts_per_rank: int, world_size: int, capacity: int):
    """The fixed-capacity send buffers: (send_x [R C, hidden], send_ids [R C] with -1 on padding rows, order, slot,
    overflowed). Pairs are sorted by expert, hence grouped by owner (`order`: the pairs so sorted); each owner's
    first C take rows [owner C, owner C + C) of the buffers (`slot`, per sorted pair), the rest go to a spare row
    past the end (`slot` R C) and raise `overflowed` (0-dim bool). So each owner receives blocks sorted by expert,
    padding last, which it places without a sort of its own (GroupedMoE.forward_blocks)."""
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    num_pairs = flat_ids.shape[0]
    owner = torch.div(flat_ids, experts_per_rank, rounding_mode="floor")
    order = torch.argsort(flat_ids, stable=True)
    sorted_owner = owner[order]
    # scatter_add, not bincount: bincount sizes its output from the largest value, which the host would wait for
    counts = torch.zeros(world_size, dtype=torch.int64, device=x.device).scatter_add_(0, owner, torch.ones_like(owner))
    place = torch.arange(num_pairs, device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_owner]
    rows = world_size * capacity
    slot = torch.where(place < capacity, sorted_owner * capacity + place, rows)
    # padding rows left unset: no expert computes them (their ids are -1) and no pair reads what comes back for them
    send_x = x.new_empty(rows + 1, x.shape[1]).index_copy_(0, slot, x[torch.div(order, k, rounding_mode="floor")])
    send_ids = flat_ids.new_full((rows + 1,), -1).index_copy_(0, slot, flat_ids[order])
    return send_x[:rows], send_ids[:rows], order, slot, (counts > capacity).any()


def pack_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token's row of the split-size dispatch as bytes, so that one all-to-all moves everything an owner needs:
    its values, then its k expert ids (int64) and routing weights (float32), the row padded to ROW_ALIGN_BYTES (each
    row's values then start where vectorized loads want them). The full ids go to every owner: an owner's backend
    adds nothing for experts it does not hold."""
    k = topk_ids.shape[1]
    ids_at = _round_up(x.shape[1] * x.element_size(), 8)
    per_token = x.new_empty(x.shape[0], _round_up(ids_at + 12 * k, ROW_ALIGN_BYTES), dtype=torch.uint8)
    per_token[:, :x.shape[1] * x.element_size()] = x.contiguous().view(torch.uint8)
    per_token[:, ids_at:ids_at + 8 * k] = topk_ids.to(torch.int64).contiguous().view(torch.uint8)
    per_token[:, ids_at + 8 * k:ids_at + 12 * k] = topk_weights.float().contiguous().view(torch.uint8)
    return per_token


def unpack_rows(rows: torch.Tensor, hidden: int, dtype: torch.dtype, k: int):
    """pack_rows' rows read back in place: (values [N, hidden] of `dtype`, expert ids [N, k], weights [N, k]), views
    with the packed row's stride."""
    ids_at = _round_up(hidden * dtype.itemsize, 8)
    return (rows[:, :hidden * dtype.itemsize].view(dtype), rows[:, ids_at:ids_at + 8 * k].view(torch.int64),
            rows[:, ids_at + 8 * k:ids_at + 12 * k].view(torch.float32))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def owned_rows(local: MoEBackend, recv_x: torch.Tensor, recv_ids: torch.Tensor, w13, w2, first_expert: int,
               blocks: int, expected_rows: int) -> torch.Tensor:
    """The owner's experts on the fixed-capacity exchange's received rows: each row a token with one expert of weight
    1, `blocks` blocks of them (one per sender) each sorted by expert; padding rows (-1) come back unset."""
    if isinstance(local, GroupedMoE):
        return local.forward_blocks(recv_x, recv_ids, w13, w2, first_expert, blocks, expected_rows)
    weights = torch.ones(recv_ids.shape[0], 1, dtype=torch.float32, device=recv_x.device)
    return local.forward(recv_x, recv_ids[:, None], weights, w13, w2, first_expert)


def owner_slots(owner: torch.Tensor, world_size: int) -> torch.Tensor:
    """How many of the (token, slot) pairs each rank owns, from the pairs' owner ranks, on the device."""
    flat = owner.reshape(-1)
    return torch.zeros(world_size, dtype=torch.int64, device=owner.device).scatter_add_(0, flat, torch.ones_like(flat))


def owned_row_sums(local: MoEBackend, recv_x: torch.Tensor, recv_ids: torch.Tensor, recv_weights: torch.Tensor, w13,
                   w2, first_expert: int, local_slots: int) -> torch.Tensor:
    """The owner's experts on the split-size exchange's received rows: each row's weighted sum over its slots that this
    rank holds (`local_slots` of them in all; the other slots are -1)."""
    if isinstance(local, GroupedMoE):
        return local.forward(recv_x, recv_ids, recv_weights, w13, w2, first_expert, local_slots)
    return local.forward(recv_x, recv_ids, recv_weights, w13, w2, first_expert)


def combine_returned(back: torch.Tensor, order: torch.Tensor, slot: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its pairs' expert outputs, read from the returned rows `back` ([R C + 1, hidden])
    at the slots place_pairs gave them; a dropped pair (slot R C, the spare row, whatever it holds) adds zero."""
    num_tokens, k = topk_ids.shape
    per_pair = torch.empty(num_tokens * k, back.shape[1], dtype=back.dtype, device=back.device)
    per_pair[order] = torch.where((slot < back.shape[0] - 1)[:, None], back[slot], 0)
    return _combine(per_pair.view(num_tokens, k, back.shape[1]), topk_ids, topk_weights, back.dtype)


@dataclass(frozen=True)
class CompiledExpertParallelMoE:
    """An ExpertParallelMoE whose fixed-capacity steps run their tensor work compiled (inductor fuses each part into
    a few kernels; the collectives stay between them, eager, so a decode graph captures them as before). Steps with
    split sizes run as the exchange's own."""

    exchange: ExpertParallelMoE
    work: FixedExchangeWork

    @classmethod
    def build(cls, exchange: ExpertParallelMoE, backend: str | Callable = "inductor") -> "CompiledExpertParallelMoE":
        owned = functools.partial(owned_rows, exchange.local)
        if isinstance(exchange.local, GroupedMoE):  # TorchMoE stays eager (it reads routing on the host)
            owned = compile_token_dynamic(owned, backend)
        return cls(exchange, FixedExchangeWork(compile_token_dynamic(place_pairs, backend), owned,
                                               compile_token_dynamic(combine_returned, backend)))

    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int, beside=None, placement=None):
        return self.exchange.forward(x, topk_ids, topk_weights, w13, w2, first_expert, self.work, beside, placement)


def overlaps_shared(backend: MoEBackend) -> bool:
    """Whether `backend` exchanges tokens and runs a layer's shared experts while they travel (forward's `beside`)."""
    exchange = backend.exchange if isinstance(backend, CompiledExpertParallelMoE) else backend
    return isinstance(exchange, ExpertParallelMoE) and exchange.overlap_shared


def _combine(expert_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum over each token's k experts, added in ascending expert id from zero (TorchMoE's order)."""
    num_tokens = expert_out.shape[0]
    slot_order = torch.argsort(topk_ids, dim=1, stable=True)
    rows = torch.arange(num_tokens, device=expert_out.device)[:, None]
    return _sum_slots((expert_out * topk_weights[..., None]).to(dtype)[rows, slot_order])


def _sum_slots(weighted: torch.Tensor) -> torch.Tensor:
    """[T, S, hidden] -> each token's S rows added slot by slot from zero: with the slots in expert order, TorchMoE's
    order of additions."""
    out = torch.zeros_like(weighted[:, 0])
    for slot in range(weighted.shape[1]):
        out += weighted[:, slot]
    return out
