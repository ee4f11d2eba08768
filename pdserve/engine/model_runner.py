"""Owns the model and the rank's KV tensor; turns a scheduled step into one forward pass and its logits."""

import torch

from pdserve.engine.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.attention import AttentionBatch


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, num_pages: int, page_size: int, device: torch.device,
                 dtype: torch.dtype, graphs: DecodeGraphConfig | None = None):
        cfg = model.cfg
        self.model = model
        self.page_size = page_size
        self.device = device
        # One tensor for every layer: [layers, pages, page_size, kv_dim]; NIXL registers it once.
        # With graphs, one extra page past the allocator's range takes the KV of padding rows.
        pool_pages = num_pages + (1 if graphs else 0)
        self.kv_cache = torch.zeros(cfg.num_hidden_layers, pool_pages, page_size, cfg.kv_dim, dtype=dtype, device=device)
        self.decode_graphs = DecodeGraphs(model, self.kv_cache, page_size, graphs, num_pages) if graphs else None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the step; returns float32 logits [num sampling seqs, vocab] in the order of `scheduled`.

        An empty `scheduled` runs a forward pass over zero tokens: under expert parallelism an idle rank still has
        to join every MoE exchange of its peers' step."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, kv_lens, sample_rows = [], [], []
        page_tables: list[list[int]] = []
        for seq in scheduled:
            request, start = seq.request, seq.request.num_computed_tokens
            end = start + seq.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(request.page_ids[p // self.page_size] * self.page_size + p % self.page_size
                         for p in range(start, end))
            query_lens.append(seq.num_new_tokens)
            kv_lens.append(end)
            page_tables.append(request.page_ids)
            if seq.samples:
                sample_rows.append(len(input_ids) - 1)
        if self.decode_graphs is not None and _is_graph_decode(scheduled, self.decode_graphs.max_batch_size):
            return self.decode_graphs.run(input_ids, positions, slots, kv_lens, page_tables)
        max_pages = max((len(p) for p in page_tables), default=0)
        page_table = torch.tensor([p + [0] * (max_pages - len(p)) for p in page_tables], dtype=torch.int64).view(
            len(page_tables), max_pages)
        batch = AttentionBatch(
            query_lens=query_lens,
            kv_lens=kv_lens,
            page_table=page_table.to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            page_size=self.page_size,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache, batch)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows])


def _is_graph_decode(scheduled: list[ScheduledSeq], max_batch_size: int) -> bool:
    return 0 < len(scheduled) <= max_batch_size and all(seq.num_new_tokens == 1 and seq.samples for seq in scheduled)
