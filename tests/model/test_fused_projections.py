"""Linears that read the same input run as one GEMM: same outputs as the separate linears, weights still loadable
by their checkpoint names (they are views of the stacked matrix), FP8 linears left alone."""

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.select import select_backends
from tests.ops.test_attention_flashinfer import make_step

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_fused_projections_compute_what_the_separate_linears_do(tiny_model_factory, arch):
    cfg = ModelConfig.from_dir(tiny_model_factory(arch))
    backends = select_backends("torch", "torch", CPU)
    fused, separate = (init_random_weights(build_model(cfg, backends, CPU, torch.float32, fuse=f), seed=5)
                       for f in (True, False))
    assert fused.state_dict().keys() == separate.state_dict().keys()  # checkpoint names unchanged
    _, kv_cache, batch = make_step([5, 1], [0, 9], 4, "cpu", seed=0)
    ids = torch.randint(2, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 1, 2, 3, 4, 8])
    kv = torch.zeros(cfg.num_hidden_layers, kv_cache.shape[0], 4, cfg.kv_dim)
    with torch.inference_mode():
        out_fused, out_separate = fused(ids, positions, kv.clone(), batch), separate(ids, positions, kv.clone(), batch)
    torch.testing.assert_close(out_fused, out_separate, rtol=1e-5, atol=1e-5)

    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert separate.model.layers[0].self_attn.input_proj is None
    first = attn.q_proj if cfg.q_lora_rank is None else attn.q_a_proj
    with torch.no_grad():  # loading writes into the weights: it lands in the stacked matrices
        first.weight[0, 0] = 7.0
        attn.kv_a_proj_with_mqa.weight[-1, -1] = 8.0
        mlp.up_proj.weight[0, 0] = 9.0
    assert attn.input_proj[0, 0] == 7.0 and attn.input_proj[-1, -1] == 8.0
    assert mlp.gate_up[mlp.gate_proj.weight.shape[0], 0] == 9.0


def test_fp8_linears_are_not_fused(tiny_model_factory):
    cfg = ModelConfig.from_dir(tiny_model_factory("v3", fp8=True))
    model = build_model(cfg, select_backends("torch", "torch", CPU), CPU, torch.float32, keep_fp8=True)
    assert all(layer.self_attn.input_proj is None for layer in model.model.layers)
    assert model.model.layers[0].mlp.gate_up is None
