"""MLA attention over the paged latent KV cache: the step's batch description and the torch reference backend.

Attention runs in the weight-absorbed form for every token: queries arrive already projected into the latent space
(q_latent = W_UK^T q_nope), keys are the cached latents plus the shared rope key, and the output stays latent
(the caller applies W_UV). The cache is never expanded to per-head keys and values.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionBatch:
    """The sequences of one step, the same for every layer. Tokens of a sequence are contiguous in the flat batch."""

    query_lens: list[int]  # new tokens of each sequence in this step
    kv_lens: list[int]  # cached + new tokens of each sequence after this step
    page_table: torch.Tensor  # [num_seqs, max_pages] int64, page ids of each sequence (padded)
    slot_mapping: torch.Tensor  # [num_tokens] int64, page * page_size + offset for each new token's KV
    page_size: int
    # Per-step state a backend builds on the first layer and every later layer reuses (e.g. a kernel plan),
    # keyed by backend; it lives and dies with this step's batch.
    plans: dict[str, object] = field(default_factory=dict, repr=False)


class AttentionBackend(Protocol):
    def forward(
        self,
        q_latent: torch.Tensor,  # [T, H, kv_lora_rank]
        q_pe: torch.Tensor,  # [T, H, rope_dim]
        latent: torch.Tensor,  # [T, kv_lora_rank] new tokens' compressed KV
        k_pe: torch.Tensor,  # [T, rope_dim] new tokens' rope key
        kv_cache: torch.Tensor,  # [num_pages, page_size, kv_lora_rank + rope_dim] this layer's pages
        batch: AttentionBatch,
        softmax_scale: float,
    ) -> torch.Tensor:  # [T, H, kv_lora_rank]
        ...


def write_kv(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat[slot_mapping] = torch.cat((latent, k_pe), dim=-1).to(kv_cache.dtype)


class TorchAttention:
    """Reference: gathers each sequence's pages and runs causal softmax attention in float32."""

    def forward(self, q_latent, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch, softmax_scale: float):
        write_kv(kv_cache, latent, k_pe, batch.slot_mapping)
        rank = q_latent.shape[-1]
        out = torch.empty_like(q_latent)
        start = 0
        for i, (n_q, n_kv) in enumerate(zip(batch.query_lens, batch.kv_lens)):
            num_pages = -(-n_kv // batch.page_size)
            kv = kv_cache[batch.page_table[i, :num_pages]].reshape(-1, kv_cache.shape[-1])[:n_kv].float()
            q_lat = q_latent[start : start + n_q].float()
            q_rope = q_pe[start : start + n_q].float()
            scores = torch.einsum("qhr,kr->hqk", q_lat, kv[:, :rank]) + torch.einsum("qhr,kr->hqk", q_rope, kv[:, rank:])
            scores = scores * softmax_scale
            # query j sits at position n_kv - n_q + j and sees keys up to there
            q_pos = torch.arange(n_kv - n_q, n_kv, device=scores.device)
            k_pos = torch.arange(n_kv, device=scores.device)
            scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + n_q] = torch.einsum("hqk,kr->qhr", probs, kv[:, :rank]).to(out.dtype)
            start += n_q
        return out
