"""Decode steps under CUDA graphs: captured once per batch size at start-up, replayed with the batch padded up.

Eager decode is bound by the host launching ~2,300 kernels a step; a replay launches them as one. What changes
between steps lives in fixed device buffers filled before each replay: token ids, positions and KV slots (one
host-to-device copy) and flashinfer's attention plan (made on the host, copied into its metadata buffers). Nothing
inside a step waits on the host. Padding rows decode token 0 at position 0 into a scratch page that no request
owns, and their logits are dropped.

Each size is captured twice. While one capture replays, the host plans the other for the step most likely next
(the same sequences, one token longer): when that step comes, only its page ids are copied in, so the 1-4 ms of
planning overlaps the GPU's work instead of preceding it. A plan depends on the lengths alone; the page ids are
data the kernels read.
"""

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from pdserve.cache.page_allocator import pages_for
from pdserve.engine.in_flight import CarriedTokens
from pdserve.model.compiled_layers import CompiledLayers
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.attention import AttentionBatch
from pdserve.ops.attention_flashinfer import WORKSPACE_BYTES, FlashInferMLA, FlashInferMLAGraphSlot
from pdserve.ops.expert_load import mark_real_rows
from pdserve.ops.moe_ep import ExpertParallelMoE
from pdserve.ops.select import Backends

if TYPE_CHECKING:
    from pdserve.ops.mla_decode_triton import TritonMLAGraphSlot

log = logging.getLogger(__name__)
T = TypeVar("T")

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class DecodeGraphConfig:
    batch_sizes: tuple[int, ...]  # captured sizes, ascending; larger decode batches run eagerly
    max_pages_per_seq: int


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The default sizes below min(max_num_seqs, 256), then that cap itself, so every decode batch up to it fits."""
    cap = min(max_num_seqs, CAPTURE_SIZES[-1])
    return tuple(s for s in CAPTURE_SIZES if s < cap) + (cap,)


def decode_graph_config(enabled: bool, model: DeepseekForCausalLM, max_num_seqs: int, max_model_len: int,
                        page_size: int) -> DecodeGraphConfig | None:
    """None where graphs cannot run: turned off, on the CPU, or attention not on flashinfer (the torch reference
    loops over sequences on the host)."""
    if not enabled:
        return None
    if not isinstance(model.backends.attention, FlashInferMLA):
        if next(model.parameters()).device.type == "cuda":
            log.info("decode runs eagerly: CUDA graphs need the flashinfer attention backend (bfloat16)")
        return None
    return DecodeGraphConfig(capture_sizes(max_num_seqs), pages_for(max_model_len, page_size))


@dataclass
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    attention: "FlashInferMLAGraphSlot | TritonMLAGraphSlot"
    logits: torch.Tensor  # [batch size, vocab] float32, rewritten by every replay
    replayed: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # recorded after each replay


@dataclass(frozen=True)
class _PlannedStep:
    size: int
    index: int  # which of the size's two captures holds the plan
    kv_lens: tuple[int, ...]  # padded, as planned


class DecodeGraphs:
    def __init__(self, model: DeepseekForCausalLM, kv_cache: torch.Tensor, page_size: int, cfg: DecodeGraphConfig,
                 scratch_page: int, exchange: ExpertParallelMoE | None = None, compiled: CompiledLayers | None = None):
        """`exchange`: under expert parallelism, each size's graph holds the exchange at that size's fixed capacity
        (every rank captures the same sizes in the same order, as their collectives require). `compiled`: the
        layers' compiled regions (and routed experts), compiled on the first capture's warm-up and captured."""
        self.model, self.kv_cache, self.page_size = model, kv_cache, page_size
        self.exchange = exchange
        self.sizes = cfg.batch_sizes
        self.scratch_page = scratch_page
        self.compiled = compiled
        self.device_wait_s = 0.0  # host time spent waiting for replays before re-planning their captures, summed
        device = kv_cache.device
        # Rows: token ids, positions, KV slots. One copy fills them; every graph reads a prefix of each row.
        self._inputs = torch.zeros(3, self.sizes[-1], dtype=torch.int64, device=device)
        # Per routed (row, expert) pair: 1 for a sequence's row, 0 for padding, so padding is not counted as load.
        self._top_k = model.cfg.num_experts_per_tok
        self._pair_valid = torch.zeros(self.sizes[-1] * self._top_k, dtype=torch.int64, device=device)
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # replays never overlap
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self._steps: dict[int, tuple[_CapturedStep, _CapturedStep]] = {}
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            self._steps[size] = tuple(self._capture(size, cfg.max_pages_per_seq, pool) for _ in range(2))
        self.max_pages_per_seq = cfg.max_pages_per_seq
        self._last_replayed: tuple[int, int] | None = None  # (size, index) of the last replay
        self._planned_ahead: _PlannedStep | None = None
        log.info("captured decode CUDA graphs for batch sizes %s (compiled layers: %s) in %.1f s", list(self.sizes),
                 compiled is not None, time.perf_counter() - started)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def _capture(self, size: int, max_pages_per_seq: int, pool) -> _CapturedStep:
        cfg = self.model.cfg
        from pdserve.ops import mla_decode_triton as split_kv  # triton: on CUDA hosts only

        if size <= split_kv.MAX_BATCH:  # small batches: the kernels the eager steps of their size run
            attention = split_kv.TritonMLAGraphSlot(size, size * max_pages_per_seq, self.page_size,
                                                    cfg.num_attention_heads, cfg.kv_lora_rank, self.kv_cache.device)
        else:
            attention = FlashInferMLAGraphSlot(
                self._workspace, size, size * max_pages_per_seq, self.page_size, cfg.num_attention_heads,
                cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.softmax_scale, self.kv_cache.dtype,
            )
        attention.plan([1] * size, [[self.scratch_page]] * size)  # all padding: a valid plan for warm-up and capture
        ids, positions, slots = self._inputs[:, :size]
        page_table = torch.zeros(size, 1, dtype=torch.int64, device=ids.device)  # unused
        load = self.model.backends.expert_load
        compiled = self.compiled
        backends = Backends(attention=attention, moe=compiled.moe if compiled else self.model.backends.moe,
                            expert_load=load.masked(self._pair_valid) if load is not None else None)
        regions = compiled.regions if compiled else None

        def step() -> torch.Tensor:
            # A batch per call: what a step derives once into its plans (write_kv's rows from the slots) is then made
            # inside the capture, from the buffer each replay refills, not kept from the warm-up call.
            batch = AttentionBatch(query_lens=[1] * size, kv_lens=[1] * size, slot_mapping=slots,
                                   page_size=self.page_size, page_table=page_table)
            return self.model.compute_logits(self.model(ids, positions, self.kv_cache, batch, backends, regions))

        if self.exchange is not None:
            self.exchange.fixed_tokens = size
        try:
            graph, logits = capture(step, pool)
        finally:
            if self.exchange is not None:
                self.exchange.fixed_tokens = None
        return _CapturedStep(graph, attention, logits)

    @torch.inference_mode()  # the plan buffers were made under inference mode, at capture
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], kv_lens: list[int],
            page_ids: list[list[int]], carried: CarriedTokens | None = None, at_least: int = 0) -> torch.Tensor:
        """One new token per sequence (at most max_batch_size); float32 logits [num seqs, vocab], valid until the
        next run but one. `carried`: input ids still on the device (the previous step's sampled tokens, under
        overlapped scheduling), copied into the graph's input buffer behind the host's. `at_least`: the size the
        expert-parallel ranks agreed on (every rank replays the same graph; an idle rank's rows are all padding)."""
        num_seqs = len(input_ids)
        size = next(s for s in self.sizes if s >= max(num_seqs, at_least, 1))
        pad = size - num_seqs
        # The device still runs the last replay: the host is ahead, so planning the next step now costs no step time.
        # When the device has finished, the host sets the pace, and a plan ahead that the next batch does not match
        # (a request joined or finished: most steps at high rates) would only be a second plan on the critical path.
        last = self._last_replayed
        device_busy = last is not None and not self._steps[last[0]][last[1]].replayed.query()
        padded_lens = kv_lens + [1] * pad
        padded_pages = page_ids + [[self.scratch_page]] * pad
        ahead = self._planned_ahead
        if ahead is not None and ahead.size == size and ahead.kv_lens == tuple(padded_lens):
            index = ahead.index
            self._steps[size][index].attention.copy_page_ids(padded_lens, padded_pages)
        else:
            index = self._free_index(size)
            self._plan(self._steps[size][index], padded_lens, padded_pages)
        step = self._steps[size][index]
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad,
                             slots + [self.scratch_page * self.page_size] * pad], dtype=torch.int64)
        self._inputs[:, :size].copy_(host, non_blocking=True)  # staged at once: no wait for a step in flight
        if self.model.backends.expert_load is not None:
            mark_real_rows(self._pair_valid, num_seqs, size, self._top_k)
        if carried is not None:
            carried.write_into(self._inputs[0, :num_seqs])
        step.graph.replay()
        step.replayed.record()
        self._last_replayed = (size, index)
        if device_busy:
            self._plan_ahead(size, kv_lens, pad)
        else:
            self._planned_ahead = None
        return step.logits[:num_seqs]

    def _plan(self, step: _CapturedStep, padded_lens: list[int], padded_pages: list[list[int]] | None) -> None:
        # flashinfer stages a plan in pinned host memory of the capture's own, copied in behind the queued work. While
        # that capture's last replay may still be queued (the host runs a step ahead under overlapped scheduling),
        # rewriting the staging memory would change the plan under it: wait for that replay first. That wait is where
        # a device-bound decode rank's host waits (the step before's replay, planning ahead), so it is counted.
        waited_from_s = time.perf_counter()
        step.replayed.synchronize()
        self.device_wait_s += time.perf_counter() - waited_from_s
        step.attention.plan(padded_lens, padded_pages)

    def _free_index(self, size: int) -> int:
        """The capture of `size` that the last replay did not use (it may still be running)."""
        last = self._last_replayed
        return 1 - last[1] if last is not None and last[0] == size else 0

    def _plan_ahead(self, size: int, kv_lens: list[int], pad: int) -> None:
        """Plan the other capture for the same sequences one token longer, while the GPU runs this step: by the
        lengths alone, as run() copies that step's page ids in (a longer sequence may own a page more by then)."""
        next_lens = [n + 1 for n in kv_lens]
        # Nothing to plan for an idle rank, nor past the longest sequence captured for.
        if not next_lens or pages_for(max(next_lens), self.page_size) > self.max_pages_per_seq:
            self._planned_ahead = None
            return
        padded_lens = next_lens + [1] * pad
        index = self._free_index(size)
        self._plan(self._steps[size][index], padded_lens, None)
        self._planned_ahead = _PlannedStep(size, index, tuple(padded_lens))


def capture(run: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` captured into a graph drawing its memory from `pool`, after one warm-up call on a side stream (lazy
    initialisation, kernel selection and compilation happen there, outside the capture); returns the graph and what
    the captured call returned (its output tensors, rewritten by every replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


def leave_process_group() -> None:
    """Destroys the default process group once no CUDA graph holds its collectives. NCCL's communicator teardown
    waits for the graphs that captured its collectives (pytorch/pytorch#115388: it hangs while one lives), so the
    caller drops every reference to its graphs first; their reference cycles are collected here."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.destroy_process_group()
