import pytest
import torch

from pdserve.ops.attention import AttentionBatch, TorchAttention, new_kv_pool

HEADS, RANK, ROPE = 16, 512, 64


def make_step(query_lens, cached_lens, page_size, device, seed=0):
    """Random queries and new KV for each sequence, over a randomly filled, scattered page pool: one layer of a
    page-major pool of three, as an engine's (its pages strided; the reference runs on a contiguous copy)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    kv_lens = [c + q for c, q in zip(cached_lens, query_lens)]
    pages_needed = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(pages_needed) + 3
    page_ids = torch.randperm(num_pages, generator=gen).tolist()  # non-contiguous pages per sequence
    tables, slots = [], []
    for seq, (n_pages, cached, n_kv) in enumerate(zip(pages_needed, cached_lens, kv_lens)):
        table, page_ids = page_ids[:n_pages], page_ids[n_pages:]
        tables.append(table + [0] * (max(pages_needed) - n_pages))
        slots.extend(table[p // page_size] * page_size + p % page_size for p in range(cached, n_kv))
    tokens = sum(query_lens)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    pool = new_kv_pool(3, num_pages, page_size, RANK + ROPE, torch.bfloat16, torch.device(device))
    pool.copy_(torch.randn(3, num_pages, page_size, RANK + ROPE, generator=gen))
    kv_cache = pool[1]
    inputs = [torch.randn(tokens, HEADS, RANK, generator=gen), torch.randn(tokens, HEADS, ROPE, generator=gen),
              torch.randn(tokens, RANK, generator=gen), torch.randn(tokens, ROPE, generator=gen)]
    batch = AttentionBatch(query_lens=list(query_lens), kv_lens=kv_lens,
                           page_table=torch.tensor(tables, dtype=torch.int64, device=device),
                           slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), page_size=page_size)
    return [t.to(**bf16) for t in inputs], kv_cache, batch


def run_both(query_lens, cached_lens, page_size):
    from pdserve.ops.attention_flashinfer import FlashInferMLA

    inputs, kv_cache, batch = make_step(query_lens, cached_lens, page_size, "cuda")
    scale = (128 + ROPE) ** -0.5
    ref_cache = kv_cache.clone()
    ref = TorchAttention().forward(*inputs, ref_cache, batch, scale)
    out = FlashInferMLA(torch.device("cuda")).forward(*inputs, kv_cache, batch, scale)
    assert torch.equal(kv_cache, ref_cache), "new KV must land in the same slots"
    return out.float(), ref.float()


def rel_err(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_flashinfer_decode_matches_torch_reference(page_size):
    out, ref = run_both(query_lens=[1] * 8, cached_lens=[5, 63, 64, 65, 200, 1000, 1, 4095], page_size=page_size)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_a_decode_step_of_a_few_sequences_runs_the_split_kv_kernels_and_matches_torch_reference():
    from pdserve.ops.attention_flashinfer import PLAN_KEY, FlashInferMLA
    from pdserve.ops.mla_decode_triton import META_KEY

    inputs, kv_cache, batch = make_step([1] * 3, [5, 4095, 64], 64, "cuda")
    scale = (128 + ROPE) ** -0.5
    ref = TorchAttention().forward(*inputs, kv_cache.clone(), batch, scale)
    out = FlashInferMLA(torch.device("cuda")).forward(*inputs, kv_cache, batch, scale)
    assert META_KEY in batch.plans and PLAN_KEY not in batch.plans
    assert rel_err(out.float(), ref.float()) < 1e-2


@pytest.mark.gpu
def test_flashinfer_causal_prefill_over_cached_prefix_matches_torch_reference():
    out, ref = run_both(query_lens=[37, 128, 1, 300], cached_lens=[0, 64, 500, 17], page_size=64)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_flashinfer_plans_once_per_step_and_replans_for_a_new_step():
    from pdserve.ops.attention_flashinfer import PLAN_KEY, FlashInferMLA

    backend = FlashInferMLA(torch.device("cuda"))
    scale = 0.1
    inputs, kv_cache, batch = make_step([2, 1], [10, 20], 16, "cuda")  # (a decode-only step of 1-4 is split-KV's)
    first = backend.forward(*inputs, kv_cache, batch, scale)
    token = batch.plans[PLAN_KEY]
    again = backend.forward(*inputs, kv_cache, batch, scale)  # a second "layer": same plan
    assert batch.plans[PLAN_KEY] is token
    assert torch.equal(first, again)
    inputs2, kv_cache2, batch2 = make_step([3], [40], 16, "cuda", seed=1)
    out2 = backend.forward(*inputs2, kv_cache2, batch2, scale)
    ref2 = TorchAttention().forward(*inputs2, kv_cache2.clone(), batch2, scale)
    assert rel_err(out2.float(), ref2.float()) < 1e-2


@pytest.mark.gpu
def test_flashinfer_expanded_prefill_over_cached_prefix_matches_torch_reference():
    from pdserve.ops.attention_flashinfer import RAGGED_PLAN_KEY, FlashInferMLA

    _, _, batch = make_step(query_lens=[37, 128, 1, 300], cached_lens=[0, 64, 500, 17], page_size=64, device="cuda")
    gen = torch.Generator(device="cpu").manual_seed(5)
    tokens, keys = sum(batch.query_lens), sum(batch.kv_lens)
    q, k = (torch.randn(n, HEADS, 192, generator=gen).to("cuda", torch.bfloat16) for n in (tokens, keys))
    v = torch.randn(keys, HEADS, 128, generator=gen).to("cuda", torch.bfloat16)
    scale = 192**-0.5
    backend = FlashInferMLA(torch.device("cuda"))
    out = backend.forward_expanded(q, k, v, batch, scale)
    token = batch.plans[RAGGED_PLAN_KEY]
    again = backend.forward_expanded(q, k, v, batch, scale)  # a second "layer": same plan
    ref = TorchAttention().forward_expanded(q, k, v, batch, scale)
    assert batch.plans[RAGGED_PLAN_KEY] is token
    assert not torch.isnan(out).any()
    assert torch.equal(out, again)
    assert rel_err(out.float(), ref.float()) < 1e-2
