"""The split-KV Triton MLA decode kernels against the float32 torch reference (pdserve.ops.attention.TorchAttention):
sequences of different lengths (chunks left empty, a partial last tile, one key), page sizes below and at a tile;
and the split kernel's own write of each sequence's newest key.
On CUDA; the kernels' logic was also checked on the CPU in Triton's interpreter, in float32 (its bf16 tl.dot is
wrong): `TRITON_INTERPRET=1` with check_matches_reference("cpu", ..., dtype=torch.float32)."""

import pytest
import torch

from pdserve.ops.attention import AttentionBatch, TorchAttention, new_kv_pool

HEADS, RANK, ROPE = 16, 512, 64
LAYERS = 3  # the cache is the middle layer of a page-major pool: its pages are strided


def check_matches_reference(device: str, kv_lens: list[int], page_size: int, splits: int,
                            dtype: torch.dtype = torch.bfloat16) -> None:
    from pdserve.ops.mla_decode_triton import attend, decode_meta, mla_decode, partials

    gen = torch.Generator(device="cpu").manual_seed(len(kv_lens) * 1000 + page_size)
    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_per_seq) + 1
    # Sequences own scattered pages (reversed order), as the pool hands them out after some churn.
    ids = list(reversed(range(num_pages)))
    page_ids, taken = [], 0
    for n in pages_per_seq:
        page_ids.append(ids[taken : taken + n])
        taken += n
    pool = new_kv_pool(LAYERS, num_pages, page_size, RANK + ROPE, dtype, torch.device(device))
    pool.copy_(torch.randn(LAYERS, num_pages, page_size, RANK + ROPE, generator=gen))
    kv_cache = pool[1]
    q_latent = torch.randn(len(kv_lens), HEADS, RANK, generator=gen).to(device, dtype)
    q_pe = torch.randn(len(kv_lens), HEADS, ROPE, generator=gen).to(device, dtype)
    scale = 0.07
    meta = decode_meta(kv_lens, page_ids, page_size).to(device)
    part_out = torch.empty(len(kv_lens), splits, HEADS, RANK, dtype=torch.float32, device=device)
    part_lse = torch.empty(len(kv_lens), splits, HEADS, dtype=torch.float32, device=device)
    out = mla_decode(q_latent, q_pe, kv_cache, meta, part_out, part_lse, page_size, scale)

    # The reference reads the same cache: its own write of the newest key rewrites that key's row with itself.
    width = max(pages_per_seq)
    page_table = torch.tensor([p + [0] * (width - len(p)) for p in page_ids], dtype=torch.int64, device=device)
    last = [page_ids[i][(n - 1) // page_size] * page_size + (n - 1) % page_size for i, n in enumerate(kv_lens)]
    slots = torch.tensor(last, dtype=torch.int64, device=device)
    newest = kv_cache[slots // page_size, slots % page_size]
    batch = AttentionBatch(query_lens=[1] * len(kv_lens), kv_lens=kv_lens, page_table=page_table,
                           slot_mapping=slots, page_size=page_size)
    ref = TorchAttention().forward(q_latent, q_pe, newest[:, :RANK], newest[:, RANK:], kv_cache, batch, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, err
    # An eager step's call, its metadata gathered from the page table on the device and each sequence's newest key
    # written by the kernel into a cache whose row for it still holds NaN: the result of the kernels with the host's
    # metadata on the written cache, at the chunk count both use, and the cache write_kv would have left.
    standard = mla_decode(q_latent, q_pe, kv_cache, meta, *partials(len(kv_lens), HEADS, RANK, device), page_size,
                          scale)
    unwritten_pool = pool.clone()  # strides kept: a page-major pool too
    unwritten = unwritten_pool[1]
    unwritten[slots // page_size, slots % page_size] = float("nan")
    assert torch.equal(attend(q_latent, q_pe, newest[:, :RANK], newest[:, RANK:], unwritten, batch, scale), standard)
    assert torch.equal(unwritten_pool, pool)  # the newest keys written where write_kv would, no other layer touched


@pytest.mark.gpu
@pytest.mark.parametrize("kv_lens,page_size,splits", [
    ([4096], 64, 64),  # batch 1 at 4k: a tile a chunk
    ([1], 64, 64),  # one key: every chunk but the first empty
    ([4000, 1, 130, 777], 64, 16),  # partial tiles and pages, empty chunks
    ([300, 65, 1000], 16, 8),  # pages smaller than a tile
])
def test_split_kv_decode_matches_torch_reference_on_gpu(kv_lens, page_size, splits):
    check_matches_reference("cuda", kv_lens, page_size, splits)
