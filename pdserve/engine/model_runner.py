"""Owns the model and the rank's KV tensor; turns a scheduled step into one forward pass and its logits."""

from dataclasses import replace

import torch

from pdserve.engine.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from pdserve.engine.device_values import on_device
from pdserve.engine.in_flight import InFlightStep
from pdserve.engine.piecewise_graphs import PiecewiseGraphConfig, PiecewiseGraphs
from pdserve.engine.prompt_logprobs import PromptRows, compute_prompt_logprobs
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.model.compiled_layers import CompiledLayers
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.attention import AttentionBatch, new_kv_pool
from pdserve.ops.moe_ep import ExpertParallelMoE


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, num_pages: int, page_size: int, device: torch.device,
                 dtype: torch.dtype, graphs: DecodeGraphConfig | None = None,
                 fixed_exchange: ExpertParallelMoE | None = None, compiled: CompiledLayers | None = None,
                 compile_eager_steps: bool = False, piecewise: PiecewiseGraphConfig | None = None):
        """`fixed_exchange`: the expert-parallel MoE backend, where decode steps use its fixed-capacity exchange.
        `compiled`: the layers' compiled regions, captured in the decode graphs, and with `compile_eager_steps` run
        by the steps outside them too (prefill chunks, mixed steps). `piecewise`: those steps replay CUDA graphs
        between their attention calls (on the CPU the same pieces run directly)."""
        cfg = model.cfg
        self.model = model
        self.compiled = compiled
        self._eager_backends, self._eager_regions = model.backends, None
        if compiled is not None and compile_eager_steps:
            self._eager_backends = replace(model.backends, moe=compiled.moe)
            self._eager_regions = compiled.regions
        self.page_size = page_size
        self.device = device
        self.fixed_exchange = fixed_exchange
        # One tensor for every layer, stored page-major and seen as [layers, pages, page_size, kv_dim]; NIXL registers
        # it once. With graphs, one extra page past the allocator's range takes the KV of padding rows.
        pool_pages = num_pages + (1 if graphs else 0)
        self.kv_cache = new_kv_pool(cfg.num_hidden_layers, pool_pages, page_size, cfg.kv_dim, dtype, device)
        self.decode_graphs = DecodeGraphs(model, self.kv_cache, page_size, graphs, num_pages, fixed_exchange,
                                          compiled) if graphs else None
        self.piecewise_graphs = PiecewiseGraphs(model, piecewise, self._eager_backends, self._eager_regions, device,
                                                dtype) if piecewise else None

    def take_device_wait_s(self) -> float:
        """Host seconds `execute` spent waiting for the device since the last call (a decode graph's capture re-planned
        only once its previous replay has run)."""
        graphs = self.decode_graphs
        if graphs is None:
            return 0.0
        waited_s, graphs.device_wait_s = graphs.device_wait_s, 0.0
        return waited_s

    def fixed_step_tokens(self, scheduled: list[ScheduledSeq]) -> int | None:
        """What this rank offers for a fixed-capacity exchange: its decode batch (0 when idle), or None where the step
        needs split sizes (a prefill chunk, or more sequences than the largest graph)."""
        if not all(seq.num_new_tokens == 1 and seq.samples for seq in scheduled):
            return None
        if self.decode_graphs is not None and len(scheduled) > self.decode_graphs.max_batch_size:
            return None
        return len(scheduled)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], previous: InFlightStep | None = None,
                fixed_tokens: int | None = None) -> torch.Tensor:
        """Run the step; returns float32 logits [num sampling seqs, vocab] in the order of `scheduled`. Nothing here
        waits for the device but a decode graph's re-plan (`take_device_wait_s`).

        `previous`: the overlapped step before this one, whose sampled tokens the host has not read yet; a sequence's
        last token may be one of them, and is then taken from the device. An empty `scheduled` runs a forward pass
        over zero tokens: under expert parallelism an idle rank still has to join every MoE exchange of its peers'
        step. `fixed_tokens`: the decode size every expert-parallel rank agreed on for the fixed-capacity exchange
        (a graph of at least that size, where graphs run); None: split sizes, eagerly."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, kv_lens, sample_rows = [], [], []
        page_tables: list[list[int]] = []
        carried_positions: list[int] = []
        carried_requests: list[Request] = []
        prompt_rows = PromptRows([], [], [])
        for seq in scheduled:
            request, start = seq.request, seq.request.num_computed_tokens
            end = start + seq.num_new_tokens
            if request.needs_prompt_logprobs:
                prompt_rows.add(request, len(input_ids), start, end)
            known = request.known_token_ids(start, end)
            input_ids.extend(known)
            if len(known) < seq.num_new_tokens:  # the token `previous` sampled last (at most one), still unresolved
                carried_positions.append(len(input_ids))
                carried_requests.append(request)
                input_ids.append(0)
            positions.extend(range(start, end))
            slots.extend(request.page_ids[p // self.page_size] * self.page_size + p % self.page_size
                         for p in range(start, end))
            query_lens.append(seq.num_new_tokens)
            kv_lens.append(end)
            page_tables.append(request.page_ids)
            if seq.samples:
                sample_rows.append(len(input_ids) - 1)
        carried = None
        if carried_requests:
            if previous is None:
                raise RuntimeError(f"request {carried_requests[0].request_id!r} has an unresolved token, but no "
                                   "step is in flight")
            carried = previous.carried(carried_positions, carried_requests)
        if self.decode_graphs is not None and (fixed_tokens is not None if self.fixed_exchange is not None
                                               else _is_graph_decode(scheduled, self.decode_graphs.max_batch_size)):
            return self.decode_graphs.run(input_ids, positions, slots, kv_lens, page_tables, carried, fixed_tokens or 0)
        max_pages = max((len(p) for p in page_tables), default=0)
        page_table = torch.tensor([p + [0] * (max_pages - len(p)) for p in page_tables], dtype=torch.int64).view(
            len(page_tables), max_pages)
        batch = AttentionBatch(
            query_lens=query_lens,
            kv_lens=kv_lens,
            page_table=page_table.to(self.device, non_blocking=True),
            slot_mapping=on_device(slots, self.device),
            page_size=self.page_size,
        )
        ids = on_device(input_ids, self.device)
        if carried is not None:
            carried.write_into(ids)
        pos = on_device(positions, self.device)
        if self.fixed_exchange is not None:
            self.fixed_exchange.fixed_tokens = fixed_tokens
        try:
            if self.piecewise_graphs is not None and self.piecewise_graphs.fits(len(input_ids)):
                hidden = self.piecewise_graphs.forward(ids, pos, self.kv_cache, batch)
            else:
                hidden = self.model(ids, pos, self.kv_cache, batch, self._eager_backends, self._eager_regions)
        finally:
            if self.fixed_exchange is not None:
                self.fixed_exchange.fixed_tokens = None
        if prompt_rows.rows:  # never a graph step: these are prefill chunks
            compute_prompt_logprobs(self.model, hidden, prompt_rows)
        rows = on_device(sample_rows, self.device)
        return self.model.compute_logits(hidden[rows])


def _is_graph_decode(scheduled: list[ScheduledSeq], max_batch_size: int) -> bool:
    return 0 < len(scheduled) <= max_batch_size and all(seq.num_new_tokens == 1 and seq.samples for seq in scheduled)
