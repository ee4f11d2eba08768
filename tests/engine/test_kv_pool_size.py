"""The KV pool's size on a GPU: whatever loading left in the caching allocator counts as free for it."""

import pytest
import torch

from pdserve import LLM

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_memory_the_caching_allocator_keeps_is_free_for_the_pool(tiny_v2):
    engine = LLM(tiny_v2, progress=False, dtype="bfloat16", cuda_graphs=False, num_pages=16).engine
    sized = engine._pages_that_fit()
    kept = torch.empty(2**30, dtype=torch.uint8, device=engine.device)
    del kept  # the allocator keeps the block: the driver still counts it as used
    assert torch.cuda.memory_reserved(engine.device) - torch.cuda.memory_allocated(engine.device) >= 2**30
    assert engine._pages_that_fit() >= sized - 1
