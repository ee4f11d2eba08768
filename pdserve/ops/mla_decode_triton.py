"""MLA decode attention for small batches: split-KV Triton kernels, for eager decode steps (through
pdserve.ops.attention_flashinfer.FlashInferMLA) and behind a decode-graph slot, so both give the same tokens.

At batch 1-4 flashinfer's MLA decode kernel is latency-bound: 17-20 us a layer on an H100 for a 4k context whose
latent cache reads in 1.6 us (docs/benchmarks.md, "MLA's backends at batch 1"). Here each sequence's keys are cut
into SPLITS equal chunks, one program each: a program holds all heads of its sequence (the latent is every head's
key and value, so it is read once), walks its chunk in BLOCK_N-key tiles with an online softmax, and writes a
float32 partial output and its log-sum-exp. A second kernel merges a sequence's chunks per head. Lengths and page ids
come from one device buffer (a graph slot's `plan()` refills it before each replay, so one captured graph serves
every step)."""

import itertools

import torch
import triton
import triton.language as tl

from pdserve.cache.page_allocator import pages_for
from pdserve.ops.attention import AttentionBatch, flat_page_ids, host_page_ids

BLOCK_N = 64  # keys per tile: one page of the default page size
# Chunks per sequence, whatever the batch: a sequence's result must not depend on its batch's size, so the eager steps
# and the padded graph steps give the same tokens. 64 was the fastest of 16-128 at batch 1-2 (4k context, one H100).
SPLITS = 64
MAX_BATCH = 4  # from 8 sequences on flashinfer's kernel is the faster (benchmarks/gpu_mla_backends.py)
META_KEY = "split_kv_meta"  # an eager step's metadata in AttentionBatch.plans
LOG2_E = 1.4426950408889634
MERGE_VALUES = 4096  # partial values one merge program holds: 32 a thread of its 4 warps


@triton.jit
def _split_kernel(q_ptr, q_pe_ptr, kv_ptr, meta_ptr, part_out_ptr, part_lse_ptr, num_seqs,
                  q_stride_t, q_stride_h, q_pe_stride_t, q_pe_stride_h, kv_page_stride, kv_row_stride, scale_log2,
                  new_latent_ptr, new_pe_ptr, new_slot_ptr, new_latent_stride, new_pe_stride,
                  HEADS: tl.constexpr, BLOCK_H: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
                  PAGE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_NEW: tl.constexpr):
    seq = tl.program_id(0)
    split = tl.program_id(1)
    # meta: [kv_lens (num_seqs), first page index of each sequence (num_seqs), flat page ids]
    kv_len = tl.load(meta_ptr + seq)
    first_page = tl.load(meta_ptr + num_seqs + seq)
    chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    h = tl.arange(0, BLOCK_H)
    r = tl.arange(0, RANK)
    e = tl.arange(0, ROPE)
    h_ok = h < HEADS
    q = tl.load(q_ptr + seq * q_stride_t + h[:, None] * q_stride_h + r[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + seq * q_pe_stride_t + h[:, None] * q_pe_stride_h + e[None, :], mask=h_ok[:, None],
                   other=0.0)
    if WRITE_NEW:
        # The step's new key (each sequence's last): the program whose chunk holds it writes it to the cache, and its
        # threads wait at a barrier (which makes the write visible to them) before any of them reads it back.
        last = kv_len - 1
        if (start <= last) & (last < end):
            slot = tl.load(new_slot_ptr + seq).to(tl.int64)
            slot = (slot // PAGE) * kv_page_stride + (slot % PAGE) * kv_row_stride
            new_latent = tl.load(new_latent_ptr + seq * new_latent_stride + r)
            tl.store(kv_ptr + slot + r, new_latent.to(kv_ptr.dtype.element_ty))
            new_pe = tl.load(new_pe_ptr + seq * new_pe_stride + e)
            tl.store(kv_ptr + slot + RANK + e, new_pe.to(kv_ptr.dtype.element_ty))
        tl.debug_barrier()
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        t = tile + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(meta_ptr + 2 * num_seqs + first_page + t // PAGE, mask=t_ok, other=0)
        row = page.to(tl.int64) * kv_page_stride + (t % PAGE) * kv_row_stride
        latent = tl.load(kv_ptr + row[:, None] + r[None, :], mask=t_ok[:, None], other=0.0)
        k_pe = tl.load(kv_ptr + row[:, None] + RANK + e[None, :], mask=t_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(latent)) + tl.dot(q_pe, tl.trans(k_pe))
        scores = tl.where(t_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)
        m = m_new
    # An empty chunk (a short sequence) leaves zeros of weight zero (its log-sum-exp is -inf).
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    lse = tl.where(denom > 0, m + tl.log2(tl.maximum(denom, 1e-30)), float("-inf"))
    part = seq * SPLITS + split
    tl.store(part_out_ptr + (part * HEADS + h[:, None]) * RANK + r[None, :], out, mask=h_ok[:, None])
    tl.store(part_lse_ptr + part * HEADS + h, lse, mask=h_ok)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, out_stride_t, out_stride_h,
                  HEADS: tl.constexpr, RANK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    parts = seq * SPLITS + s
    lse = tl.load(part_lse_ptr + parts * HEADS + head)
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # every sequence has a key, so some chunk's weight is 1
    partial = tl.load(part_out_ptr + (parts[:, None] * HEADS + head) * RANK + r[None, :])
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + r, out.to(out_ptr.dtype.element_ty))


def takes(batch: AttentionBatch) -> bool:
    """Whether a step's attention runs here: decode only (one query a sequence), at most MAX_BATCH sequences."""
    return 0 < len(batch.query_lens) <= MAX_BATCH and all(n == 1 for n in batch.query_lens)


def partials(batch_size: int, num_heads: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for the chunks' float32 outputs [B, SPLITS, H, rank] and log-sum-exps [B, SPLITS, H]."""
    return (torch.empty(batch_size, SPLITS, num_heads, rank, dtype=torch.float32, device=device),
            torch.empty(batch_size, SPLITS, num_heads, dtype=torch.float32, device=device))


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta: torch.Tensor,
               part_out: torch.Tensor, part_lse: torch.Tensor, page_size: int, softmax_scale: float,
               new_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per sequence: q_latent [B, H, rank], q_pe [B, H, rope], kv_cache [pages, page_size, rank + rope]
    (one layer of the page-major pool: pages any stride apart); meta int32 as decode_meta() lays it out; part_out and
    part_lse from partials() (or any chunk count, a power of two). `new_rows`: (latent [B, rank], k_pe [B, rope],
    slots [B]): each sequence's last key, written to the cache here (write_kv's work, without its kernels) instead of
    before. Returns [B, H, rank] in q_latent's dtype."""
    num_seqs, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    splits = part_lse.shape[1]
    out = torch.empty_like(q_latent)
    # The kernel reads a new row's values one after another: the last dimension must be contiguous.
    rows = new_rows or (q_latent, q_pe, meta)
    new_latent, new_pe, new_slots = (t if t.stride(-1) == 1 else t.contiguous() for t in rows)
    _split_kernel[(num_seqs, splits)](
        q_latent, q_pe, kv_cache, meta, part_out, part_lse, num_seqs,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        softmax_scale * LOG2_E, new_latent, new_pe, new_slots, new_latent.stride(0), new_pe.stride(0),
        HEADS=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)), RANK=rank, ROPE=rope,
        PAGE=page_size, SPLITS=splits, BLOCK_N=BLOCK_N, WRITE_NEW=new_rows is not None, num_warps=4, num_stages=2)
    block_r = min(rank, MERGE_VALUES // splits)  # a [splits, block_r] float32 tile in registers
    _merge_kernel[(num_seqs, heads, rank // block_r)](part_out, part_lse, out, out.stride(0), out.stride(1),
                                                      HEADS=heads, RANK=rank, SPLITS=splits, BLOCK_R=block_r,
                                                      num_warps=4)
    return out


def meta_header(kv_lens: list[int], page_size: int) -> list[int]:
    """The metadata's head: the lengths, then each sequence's first index into the flat page ids."""
    return [*kv_lens, 0, *itertools.accumulate(pages_for(n, page_size) for n in kv_lens[:-1])]


def decode_meta(kv_lens: list[int], page_ids: list[list[int]], page_size: int) -> torch.Tensor:
    """The kernels' int32 metadata on the host: meta_header(), then each sequence's pages one after another."""
    header = torch.tensor(meta_header(kv_lens, page_size), dtype=torch.int32)
    return torch.cat((header, host_page_ids(page_ids, [pages_for(n, page_size) for n in kv_lens])))


def attend(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
           kv_cache: torch.Tensor, batch: AttentionBatch, softmax_scale: float) -> torch.Tensor:
    """An eager decode step's attention (takes() holds), its new keys written to the cache by the kernel: the
    metadata made on the first layer, without a sync."""
    meta = batch.plans.get(META_KEY)
    if meta is None:
        header = torch.tensor(meta_header(batch.kv_lens, batch.page_size), dtype=torch.int32)
        page_ids = flat_page_ids(batch, [pages_for(n, batch.page_size) for n in batch.kv_lens])
        meta = batch.plans[META_KEY] = torch.cat((header.to(q_latent.device, non_blocking=True), page_ids))
    return mla_decode(q_latent, q_pe, kv_cache, meta, *partials(*q_latent.shape, q_latent.device), batch.page_size,
                      softmax_scale, (latent, k_pe, batch.slot_mapping))


class TritonMLAGraphSlot:
    """Decode attention for one CUDA-graph batch size on the split-KV kernels (the interface of
    pdserve.ops.attention_flashinfer.FlashInferMLAGraphSlot): `plan()` copies lengths and page ids into the buffer the
    captured kernels read, `forward()` is what the graph captures."""

    def __init__(self, batch_size: int, max_kv_pages: int, page_size: int, num_heads: int, head_dim_ckv: int,
                 device: torch.device):
        self.page_size = page_size
        self.meta = torch.zeros(2 * batch_size + max_kv_pages, dtype=torch.int32, device=device)
        self.partials = partials(batch_size, num_heads, head_dim_ckv, device)

    def plan(self, kv_lens: list[int], page_ids: list[list[int]] | None) -> None:
        """kv_lens/page_ids of exactly `batch_size` sequences (padding rows included). page_ids None: nothing yet,
        as the kernels split work by the lengths they read with the ids: copy_page_ids() writes both."""
        if page_ids is None:
            return
        meta = decode_meta(kv_lens, page_ids, self.page_size)
        self.meta[: meta.numel()].copy_(meta, non_blocking=True)

    copy_page_ids = plan

    def forward(self, q_latent, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch, softmax_scale: float):
        return mla_decode(q_latent, q_pe, kv_cache, self.meta, *self.partials, self.page_size, softmax_scale,
                          (latent, k_pe, batch.slot_mapping))
