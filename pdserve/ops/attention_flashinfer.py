"""MLA attention on flashinfer: paged MLA kernels for the absorbed form, ragged prefill for the expanded form.
One plan per step and form, reused by every layer.

The layer's cache tensor [pages, page_size, kv_lora_rank + rope_dim] is passed as flashinfer's "packed" KV layout
(latent and rope key side by side in each row), so the pool needs no second layout and no copy. Decode and
prefill over a cached prefix are the same call: causal, with each query aligned to the end of its sequence.
"""

import itertools

import torch

from pdserve.cache.page_allocator import pages_for
from pdserve.ops.attention import AttentionBatch, flat_page_ids, host_page_ids, write_kv

PLAN_KEY = "flashinfer_mla"
RAGGED_PLAN_KEY = "flashinfer_ragged"
# (qk, v) head widths of the ragged prefill kernels flashinfer builds for Hopper (FA3), DeepSeek's 192/128 among
# them; other widths compile for the generic kernels without being covered by their tests, so they stay absorbed.
EXPANDED_HEAD_DIMS = {(64, 64), (128, 128), (256, 256), (192, 128)}
WORKSPACE_BYTES = 128 << 20


class FlashInferMLA:
    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # imported only when this backend is chosen
        from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

        self.wrapper = BatchMLAPagedAttentionWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=device), backend="auto")
        self.ragged = BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=device), kv_layout="NHD", backend="auto")
        self._plan_tokens: dict[str, object] = {}  # per wrapper: names the batch it is planned for

    def forward(self, q_latent, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch, softmax_scale: float):
        if not batch.query_lens:  # an idle expert-parallel rank's empty step: nothing to plan or attend
            return torch.empty_like(q_latent)
        from pdserve.ops import mla_decode_triton as split_kv  # triton: on CUDA hosts only, as this backend

        if split_kv.takes(batch):  # what the decode graphs of this size run: eager steps give their tokens
            return split_kv.attend(q_latent, q_pe, latent, k_pe, kv_cache, batch, softmax_scale)
        write_kv(kv_cache, latent, k_pe, batch)
        if self._needs_plan(PLAN_KEY, batch):
            self._plan(q_latent, q_pe, kv_cache, batch, softmax_scale)
        return self.wrapper.run(query=(q_latent, q_pe), kv_cache=kv_cache)

    def expands(self, qk_dim: int, v_dim: int) -> bool:
        return (qk_dim, v_dim) in EXPANDED_HEAD_DIMS

    def forward_expanded(self, q, k, v, batch: AttentionBatch, softmax_scale: float):
        if self._needs_plan(RAGGED_PLAN_KEY, batch):
            self.ragged.plan(
                qo_indptr=_indptr(batch.query_lens), kv_indptr=_indptr(batch.kv_lens),
                num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim_qk=q.shape[2], head_dim_vo=v.shape[2],
                causal=True, sm_scale=softmax_scale, q_data_type=q.dtype, kv_data_type=k.dtype,
            )
            self._mark_planned(RAGGED_PLAN_KEY, batch)
        return self.ragged.run(q, k, v)

    def _needs_plan(self, key: str, batch: AttentionBatch) -> bool:
        token = self._plan_tokens.get(key)
        return token is None or batch.plans.get(key) is not token

    def _mark_planned(self, key: str, batch: AttentionBatch) -> None:
        self._plan_tokens[key] = batch.plans[key] = object()

    def _plan(self, q_latent, q_pe, kv_cache, batch: AttentionBatch, softmax_scale: float) -> None:
        from flashinfer.mla import MLAPlanMetadata

        pages_per_seq = [pages_for(n, batch.page_size) for n in batch.kv_lens]
        kv_indices = flat_page_ids(batch, pages_per_seq)
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
        self._mark_planned(PLAN_KEY, batch)


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


class FlashInferMLAGraphSlot:
    """Decode attention for one CUDA-graph batch size: one query per sequence, metadata in fixed device buffers.

    `plan()` runs on the host before each replay and refills the buffers the captured kernels read, so one captured
    graph serves every step of that batch size whatever its pages and context lengths (flashinfer's
    `use_cuda_graph=True` mode). `forward()` only writes the new KV and runs: it is what the graph captures.
    """

    def __init__(self, workspace: torch.Tensor, batch_size: int, max_kv_pages: int, page_size: int,
                 num_heads: int, head_dim_ckv: int, head_dim_kpe: int, softmax_scale: float, dtype: torch.dtype):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        device = workspace.device
        self.batch_size, self.page_size = batch_size, page_size
        self._plan_args = dict(num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                               page_size=page_size, causal=True, sm_scale=softmax_scale, q_data_type=dtype,
                               kv_data_type=dtype, query_layout="split", kv_cache_layout="packed")
        self._qo_indptr = torch.arange(batch_size + 1, dtype=torch.int32)  # one query each, never changes
        self._kv_indices = torch.empty(max_kv_pages, dtype=torch.int32, device=device)
        self.wrapper = BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True,
            qo_indptr=torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            kv_indptr=torch.empty(batch_size + 1, dtype=torch.int32, device=device),
            kv_indices=self._kv_indices,
            kv_len_arr=torch.empty(batch_size, dtype=torch.int32, device=device),
            backend="auto",
        )

    def plan(self, kv_lens: list[int], page_ids: list[list[int]] | None) -> None:
        """kv_lens/page_ids of exactly `batch_size` sequences (padding rows included). page_ids None: a plan by the
        lengths alone, whose page ids copy_page_ids() writes before the replay (zeros until then)."""
        from flashinfer.mla import MLAPlanMetadata

        pages_per_seq = [pages_for(n, self.page_size) for n in kv_lens]
        if page_ids is None:  # the plan splits work by length only: no host array of every page id
            kv_indices = torch.zeros(sum(pages_per_seq), dtype=torch.int32, device=self.wrapper.device)
        else:
            kv_indices = host_page_ids(page_ids, pages_per_seq).to(self.wrapper.device, non_blocking=True)
        metadata = MLAPlanMetadata.csr(
            qo_indptr=self._qo_indptr,
            kv_indptr=_indptr(pages_per_seq),
            kv_indices=kv_indices,
            kv_len_arr=torch.tensor(kv_lens, dtype=torch.int32),
        )
        self.wrapper.plan(metadata=metadata, **self._plan_args)

    def copy_page_ids(self, kv_lens: list[int], page_ids: list[list[int]]) -> None:
        """New page ids for the lengths the wrapper is planned for: the plan splits work by length only, and the
        kernels read the page ids from this buffer."""
        flat = host_page_ids(page_ids, [pages_for(n, self.page_size) for n in kv_lens])
        self._kv_indices[: flat.numel()].copy_(flat, non_blocking=True)

    def forward(self, q_latent, q_pe, latent, k_pe, kv_cache, batch: AttentionBatch, softmax_scale: float):
        write_kv(kv_cache, latent, k_pe, batch)
        return self.wrapper.run(query=(q_latent, q_pe), kv_cache=kv_cache)
