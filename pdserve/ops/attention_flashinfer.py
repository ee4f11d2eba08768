"""MLA attention on flashinfer's paged MLA kernels: one plan per step, reused by every layer.

The layer's cache tensor [pages, page_size, kv_lora_rank + rope_dim] is passed as flashinfer's "packed" KV layout
(latent and rope key side by side in each row), so the pool needs no second layout and no copy. Decode and
prefill over a cached prefix are the same call: causal, with each query aligned to the end of its sequence.
"""

import itertools

import torch

from pdserve.ops.attention import AttentionBatch, write_kv

PLAN_KEY = "flashinfer_mla"
WORKSPACE_BYTES = 128 << 20


class FlashInferMLA:
    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # imported only when this backend is chosen

        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        self._plan_token: object | None = None  # names the batch the wrapper is planned for

    def forward(self, q_latent, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch, softmax_scale: float):
        if not batch.query_lens:  # an idle expert-parallel rank's empty step: nothing to plan or attend
            return torch.empty_like(q_latent)
        write_kv(kv_cache, latent, k_pe, batch.slot_mapping)
        if self._plan_token is None or batch.plans.get(PLAN_KEY) is not self._plan_token:
            self._plan(q_latent, q_pe, kv_cache, batch, softmax_scale)
        return self.wrapper.run(query=(q_latent, q_pe), kv_cache=kv_cache)

    def _plan(self, q_latent, q_pe, kv_cache, batch: AttentionBatch, softmax_scale: float) -> None:
        from flashinfer.mla import MLAPlanMetadata

        pages_per_seq = [-(-n // batch.page_size) for n in batch.kv_lens]
        max_pages = batch.page_table.shape[1]
        # Flat page ids of every sequence, gathered on the device from host-known positions (no device->host sync).
        flat_positions = [seq * max_pages + p for seq, n in enumerate(pages_per_seq) for p in range(n)]
        positions = torch.tensor(flat_positions, dtype=torch.int64).to(batch.page_table.device, non_blocking=True)
        kv_indices = batch.page_table.reshape(-1)[positions].to(torch.int32)
        metadata = MLAPlanMetadata.csr(
            qo_indptr=_indptr(batch.query_lens),
            kv_indptr=_indptr(pages_per_seq),
            kv_indices=kv_indices,
            kv_len_arr=torch.tensor(batch.kv_lens, dtype=torch.int32),
        )
        self.wrapper.plan(
            metadata=metadata,
            num_heads=q_latent.shape[1],
            head_dim_ckv=q_latent.shape[2],
            head_dim_kpe=q_pe.shape[2],
            page_size=batch.page_size,
            causal=True,
            sm_scale=softmax_scale,
            q_data_type=q_latent.dtype,
            kv_data_type=kv_cache.dtype,
            query_layout="split",
            kv_cache_layout="packed",
        )
        self._plan_token = object()
        batch.plans[PLAN_KEY] = self._plan_token


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
