"""MLA attention over the paged latent KV cache: the step's batch description and the torch reference backend.

The cache holds latents only. Attention runs in one of two forms, chosen by the model per step:
- absorbed (`forward`): queries arrive projected into the latent space (q_latent = W_UK^T q_nope), keys are the
  cached latents plus the shared rope key, the output stays latent (the caller applies W_UV). Cheapest when each
  query attends to many keys, as in decode.
- expanded (`forward_expanded`): the caller expands every key's latent into per-head keys and values (192/128
  wide on DeepSeek instead of 576/512) and attention is plain multi-head attention over a flat, ragged K/V.
  About 3x fewer attention FLOPs; worth it when the new tokens outnumber what expanding the keys costs (prefill).
"""

import itertools
import math
import mmap
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.cache.page_allocator import pages_for


@dataclass
class AttentionBatch:
    """The sequences of one step, the same for every layer. Tokens of a sequence are contiguous in the flat batch."""

    query_lens: list[int]  # new tokens of each sequence in this step
    kv_lens: list[int]  # cached + new tokens of each sequence after this step
    page_table: torch.Tensor  # [num_seqs, max_pages] int64, page ids of each sequence (padded)
    slot_mapping: torch.Tensor  # [num_tokens] int64, page * page_size + offset for each new token's KV
    page_size: int
    # Per-step state built on the first layer and reused by every later one (a kernel plan, the KV slots of every
    # key), keyed by its owner; it lives and dies with this step's batch.
    plans: dict[str, object] = field(default_factory=dict, repr=False)


class AttentionBackend(Protocol):
    def forward(
        self,
        q_latent: torch.Tensor,  # [T, H, kv_lora_rank]
        q_pe: torch.Tensor,  # [T, H, rope_dim]
        latent: torch.Tensor,  # [T, kv_lora_rank] new tokens' compressed KV
        k_pe: torch.Tensor,  # [T, rope_dim] new tokens' rope key
        kv_cache: torch.Tensor,  # [num_pages, page_size, kv_lora_rank + rope_dim] this layer's pages (strided)
        batch: AttentionBatch,
        softmax_scale: float,
    ) -> torch.Tensor:  # [T, H, kv_lora_rank]
        ...

    def expands(self, qk_dim: int, v_dim: int) -> bool:
        """Whether `forward_expanded` runs heads of these widths."""
        ...

    def forward_expanded(
        self,
        q: torch.Tensor,  # [T, H, qk_dim] new tokens' queries
        k: torch.Tensor,  # [sum(kv_lens), H, qk_dim] every key of each sequence, sequences one after another
        v: torch.Tensor,  # [sum(kv_lens), H, v_dim]
        batch: AttentionBatch,
        softmax_scale: float,
    ) -> torch.Tensor:  # [T, H, v_dim]
        ...


KV_SLOTS_KEY = "kv_slots"  # every cached key of each sequence, as (page, row)
NEW_ROWS_KEY = "kv_new_rows"  # the step's new keys, as (page, row)


def gather_kv(kv_cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Every cached row of each sequence, in order: [sum(kv_lens), kv_dim]. The slots are computed on the device
    from host-known lengths once per step, without waiting for the device (torch.tensor(list, device=...) would: it
    copies blocking, behind every queued kernel)."""
    slots = batch.plans.get(KV_SLOTS_KEY)
    if slots is None:
        device = batch.page_table.device
        kv_lens = host_ints(batch.kv_lens, "q", torch.int64).to(device, non_blocking=True)
        total = sum(batch.kv_lens)
        seq = torch.repeat_interleave(torch.arange(len(batch.kv_lens), device=device), kv_lens, output_size=total)
        pos = torch.arange(total, device=device) - (kv_lens.cumsum(0) - kv_lens)[seq]
        slots = (batch.page_table[seq, pos // batch.page_size], pos % batch.page_size)
        batch.plans[KV_SLOTS_KEY] = slots
    return kv_cache[slots]


def host_ints(values: Iterable[int], typecode: str, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over a packed array: for the tens of thousands of page ids of a large batch, several times
    faster than torch.tensor(list), which inspects every element (~2 ms of a batch-256 x 4k decode step)."""
    return torch.frombuffer(array(typecode, values), dtype=dtype)


def host_page_ids(page_ids: list[list[int]], pages_per_seq: list[int]) -> torch.Tensor:
    """Each sequence's first pages_per_seq page ids one after another, int32 on the host."""
    return host_ints(itertools.chain.from_iterable(p[:n] for p, n in zip(page_ids, pages_per_seq)), "i", torch.int32)


def flat_page_ids(batch: AttentionBatch, pages_per_seq: list[int]) -> torch.Tensor:
    """Each sequence's first pages_per_seq pages one after another, int32 on the device, gathered there from
    host-known positions (no device->host sync)."""
    max_pages = batch.page_table.shape[1]
    flat_positions = (seq * max_pages + p for seq, n in enumerate(pages_per_seq) for p in range(n))
    positions = host_ints(flat_positions, "q", torch.int64).to(batch.page_table.device, non_blocking=True)
    return batch.page_table.reshape(-1)[positions].to(torch.int32)


def write_kv(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, batch: AttentionBatch) -> None:
    """Each new token's row into its slot of one layer's pages. A layer is a strided view of the page-major pool, not
    one flat run of rows, so a slot is addressed as (page, row), split once per step."""
    rows = batch.plans.get(NEW_ROWS_KEY)
    if rows is None:
        rows = batch.plans[NEW_ROWS_KEY] = (batch.slot_mapping // batch.page_size, batch.slot_mapping % batch.page_size)
    kv_cache[rows] = torch.cat((latent, k_pe), dim=-1).to(kv_cache.dtype)


def new_kv_pool(num_layers: int, num_pages: int, page_size: int, kv_dim: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A rank's KV pool: one tensor stored page-major, [pages, layers, page_size, kv_dim], so that a page's rows of
    every layer are one byte range and a run of pages is one range for a KV transfer (NIXL's post call costs ~10 us
    a range; layer-major, a request's pages were a range per layer). Returned as the layer-first view [layers, pages,
    page_size, kv_dim] the model indexes by layer: each layer's pages are then `layers` page-rows apart, which the
    attention kernels take as their page stride."""
    shape = (num_pages, num_layers, page_size, kv_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device).transpose(0, 1)
    # On the CPU a private anonymous mapping (as malloc makes for large blocks, but guaranteed zero): the kernel gives
    # each page as zeros when it is first touched, where torch.zeros would write the whole pool at start (~0.4 s a
    # GiB on the 2-core machine) and keep it resident while most of it is never used. The tensor holds the mapping.
    elements = math.prod(shape)
    mapping = mmap.mmap(-1, elements * dtype.itemsize, flags=mmap.MAP_PRIVATE)
    pool = torch.frombuffer(mapping, dtype=dtype, count=elements)
    return pool.view(shape).transpose(0, 1)


class TorchAttention:
    """Reference: gathers each sequence's pages and runs causal softmax attention in float32."""

    def forward(self, q_latent, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch, softmax_scale: float):
        write_kv(kv_cache, latent, k_pe, batch)
        rank = q_latent.shape[-1]
        out = torch.empty_like(q_latent)
        start = 0
        for i, (n_q, n_kv) in enumerate(zip(batch.query_lens, batch.kv_lens)):
            num_pages = pages_for(n_kv, batch.page_size)
            kv = kv_cache[batch.page_table[i, :num_pages]].reshape(-1, kv_cache.shape[-1])[:n_kv].float()
            q_lat = q_latent[start : start + n_q].float()
            q_rope = q_pe[start : start + n_q].float()
            scores = torch.einsum("qhr,kr->hqk", q_lat, kv[:, :rank]) + torch.einsum("qhr,kr->hqk", q_rope, kv[:, rank:])
            probs = _causal_softmax(scores * softmax_scale, n_q, n_kv)
            out[start : start + n_q] = torch.einsum("hqk,kr->qhr", probs, kv[:, :rank]).to(out.dtype)
            start += n_q
        return out

    def expands(self, qk_dim: int, v_dim: int) -> bool:
        return True

    def forward_expanded(self, q, k, v, batch: AttentionBatch, softmax_scale: float):
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        q_start = kv_start = 0
        for n_q, n_kv in zip(batch.query_lens, batch.kv_lens):
            q_seq, k_seq, v_seq = (t.float() for t in (q[q_start : q_start + n_q], k[kv_start : kv_start + n_kv],
                                                       v[kv_start : kv_start + n_kv]))
            probs = _causal_softmax(torch.einsum("qhd,khd->hqk", q_seq, k_seq) * softmax_scale, n_q, n_kv)
            out[q_start : q_start + n_q] = torch.einsum("hqk,khd->qhd", probs, v_seq).to(out.dtype)
            q_start, kv_start = q_start + n_q, kv_start + n_kv
        return out


def _causal_softmax(scores: torch.Tensor, n_q: int, n_kv: int) -> torch.Tensor:
    """scores [H, n_q, n_kv]: query j sits at position n_kv - n_q + j and sees keys up to there."""
    q_pos = torch.arange(n_kv - n_q, n_kv, device=scores.device)
    k_pos = torch.arange(n_kv, device=scores.device)
    return torch.softmax(scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf")), dim=-1)
