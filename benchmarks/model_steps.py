"""What the model benchmarks share, with no engine imports (a GPU host without the engine's extras runs them):
one step's inputs over contiguous pages, and the float32 reference logits of a model's own weights."""

import copy

import torch
import torch.nn.functional as F

from pdserve.model.deepseek import uses_expanded_attention
from pdserve.ops.attention import AttentionBatch, TorchAttention
from pdserve.ops.moe import TorchMoE
from pdserve.ops.select import Backends


def contiguous_batch(query_lens: list[int], kv_lens: list[int], page_size: int, device) -> AttentionBatch:
    """Sequence i owns a contiguous run of pages; its new tokens sit at the end of its context."""
    pages = [-(-n // page_size) for n in kv_lens]
    first = [sum(pages[:i]) for i in range(len(pages))]
    table = [[f + p for p in range(max(pages))] for f in first]
    slots = [(f + pos // page_size) * page_size + pos % page_size
             for f, q, n in zip(first, query_lens, kv_lens) for pos in range(n - q, n)]
    return AttentionBatch(query_lens=query_lens, kv_lens=kv_lens, page_size=page_size,
                          page_table=torch.tensor(table, dtype=torch.int64, device=device),
                          slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device))


def step_inputs(query_lens, kv_lens, vocab, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(query_lens),), generator=gen).to(device)
    positions = torch.tensor([p for q, n in zip(query_lens, kv_lens) for p in range(n - q, n)], device=device)
    last_rows = torch.tensor(list(torch.tensor(query_lens).cumsum(0) - 1), device=device)
    return ids, positions, last_rows


@torch.inference_mode()
def float32_reference_logits(model, ids, positions, batch, last_rows) -> torch.Tensor:
    """The same weights upcast one layer at a time (a float32 copy of the whole model would not fit next to it)."""
    cfg = model.cfg
    backends = Backends(attention=TorchAttention(), moe=TorchMoE())
    kv = torch.zeros(batch.page_table.max().item() + 1, batch.page_size, cfg.kv_dim, device=ids.device)
    rotations = model.rope.rotations(positions)
    x = model.model.embed_tokens.weight[ids].float()
    expanded = uses_expanded_attention(cfg, batch)
    for layer in model.model.layers:
        x = copy.deepcopy(layer).float()(x, rotations, model.rope, kv, batch, backends, expanded)
    x = copy.deepcopy(model.model.norm).float()(x)
    return F.linear(x[last_rows], model.lm_head.weight.float())
