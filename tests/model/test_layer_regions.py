"""Compiled layer regions trace whole (no graph breaks), are compiled once for every layer and batch size, and compute
what the eager layers do. Traced here with aot_eager (no code generation: the CPU test stays fast); inductor's fused
kernels run on the GPU (tests/engine/test_cuda_graphs.py)."""

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.compiled_layers import compile_layers
from pdserve.model.deepseek import uses_expanded_attention
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.select import select_backends
from tests.counting_backend import CountingBackend
from tests.ops.test_attention_flashinfer import make_step


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_compiled_regions_compute_the_eager_layers_once_compiled_for_all_layers_and_sizes(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch, num_hidden_layers=4)
    cfg = ModelConfig.from_dir(model_dir)
    assert sum(cfg.is_moe_layer(i) for i in range(4)) in (2, 3)  # dense and MoE layers both present
    model = init_random_weights(build_model(cfg, select_backends("torch", "torch", torch.device("cpu")),
                                            torch.device("cpu"), torch.float32), seed=1)
    torch._dynamo.reset()
    counting = CountingBackend()
    regions = compile_layers(model, counting).regions
    expanded = []
    for step, (query_lens, cached_lens) in enumerate((([1, 1], [9, 30]), ([1, 1, 1, 1, 1], [3, 8, 5, 17, 2]),
                                                      ([1] * 3, [4, 4, 40]), ([40, 1], [0, 8]))):
        _, kv_cache, batch = make_step(query_lens, cached_lens, 4, "cpu", seed=step)
        kv = torch.randn(cfg.num_hidden_layers, kv_cache.shape[0], 4, cfg.kv_dim, generator=torch.Generator().manual_seed(step))
        ids = torch.randint(2, cfg.vocab_size, (sum(query_lens),), generator=torch.Generator().manual_seed(step))
        positions = torch.tensor([p for q, n in zip(query_lens, batch.kv_lens) for p in range(n - q, n)])
        eager_kv, compiled_kv = kv.clone(), kv.clone()
        with torch.inference_mode():
            eager = model(ids, positions, eager_kv, batch)
            compiled = model(ids, positions, compiled_kv, batch, regions=regions)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled_kv, eager_kv, rtol=1e-5, atol=1e-5)
        assert not torch.equal(eager_kv, kv)
        expanded.append(uses_expanded_attention(cfg, batch))
    assert expanded == [False, False, False, True]
    # One graph per variant, shared by the 4 layers and every batch size: attention inputs in the absorbed and the
    # expanded form (the last step, a prefill), attention outputs in both forms for dense and MoE layers, MLP outputs
    # for dense layers and for MoE layers of a few tokens (the shared experts in the routed kernels' slots) and of
    # many: 2 + 4 + 3.
    assert counting.graphs == 9
