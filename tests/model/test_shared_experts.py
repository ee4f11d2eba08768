"""Shared experts stacked with the routed ones (MoE.stack_shared_experts): the same MoE output as the dense shared MLP
added after the routed sum, computed by each MoE backend; load counts and expert memory still count routed experts
only; ranks that do not hold every routed expert stack nothing."""

import json

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import SHARED_SLOTS_MAX_TOKENS, MoE
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.attention import TorchAttention
from pdserve.ops.expert_load import ExpertLoad
from pdserve.ops.moe import ExpertRange, TorchMoE
from pdserve.ops.moe_grouped import GroupedMoE
from pdserve.ops.select import Backends
from benchmarks.gpu_logits_error import DEFAULT_CONFIG

ROUTED, SHARED, TOP_K, HIDDEN, INTER = 8, 2, 3, 64, 32


def moe_config() -> ModelConfig:
    """V2-Lite's config cut down: 2 layers (a dense one, then MoE), greedy top-3 of 8 routed experts, 2 shared."""
    return ModelConfig.from_dict(json.loads(DEFAULT_CONFIG.read_text()) | {
        "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": ROUTED, "n_shared_experts": SHARED,
        "num_experts_per_tok": TOP_K, "topk_method": "greedy", "hidden_size": HIDDEN, "intermediate_size": 128,
        "moe_intermediate_size": INTER, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 128,
        "kv_lora_rank": 32, "q_lora_rank": None})


def moe_output(moe: MoE, h: torch.Tensor, backend, load: ExpertLoad | None = None) -> torch.Tensor:
    routed_ids, slot_ids, slot_weights = moe.choose(h)
    return moe.combine(h, moe.routed(h, routed_ids, slot_ids, slot_weights, backend, load))


@pytest.mark.parametrize("backend", [TorchMoE(), GroupedMoE()], ids=["torch", "grouped"])
@pytest.mark.parametrize("tokens", [SHARED_SLOTS_MAX_TOKENS, SHARED_SLOTS_MAX_TOKENS + 1], ids=["slots", "dense"])
def test_stacked_shared_experts_give_the_dense_shared_mlp_output(backend, tokens):
    torch.manual_seed(0)
    moe = MoE(moe_config(), layer_idx=1, experts=ExpertRange(0, ROUTED))
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=param.shape[-1] ** -0.5)
    h = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        dense = moe_output(moe, h, backend)
        moe.stack_shared_experts()
        assert moe.experts.w13.shape[0] == ROUTED + SHARED
        routed_ids, slot_ids, slot_weights = moe.choose(h)
        in_slots = tokens <= SHARED_SLOTS_MAX_TOKENS
        assert slot_ids.shape == (tokens, TOP_K + SHARED * in_slots) and torch.equal(slot_ids[:, :TOP_K], routed_ids)
        if in_slots:
            assert (slot_ids[:, TOP_K:] == torch.tensor([8, 9])).all() and (slot_weights[:, TOP_K:] == 1).all()
        stacked = moe_output(moe, h, backend)
    torch.testing.assert_close(stacked, dense, rtol=1e-5, atol=1e-5)


def test_load_counts_see_the_routed_experts_only():
    moe = MoE(moe_config(), layer_idx=0, experts=ExpertRange(0, ROUTED))
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.1)
    moe.stack_shared_experts()
    load = ExpertLoad.zeros(1, ROUTED, torch.device("cpu"))
    with torch.no_grad():
        moe_output(moe, torch.randn(5, HIDDEN), TorchMoE(), load)
    assert load.counts.sum().item() == 5 * TOP_K


def test_a_rank_holding_every_expert_stacks_and_counts_routed_bytes_alone():
    cfg = moe_config()
    backends = Backends(TorchAttention(), TorchMoE())
    model = build_model(cfg, backends, torch.device("cpu"), torch.float32)
    routed_bytes = model.routed_expert_bytes()
    init_random_weights(model, seed=0)  # finishes the weights as loading does
    moe = next(layer.mlp for layer in model.model.layers if layer.is_moe)
    assert moe.experts.stacked_shared == SHARED
    assert model.routed_expert_bytes() == routed_bytes

    half = init_random_weights(build_model(cfg, backends, torch.device("cpu"), torch.float32,
                                           ExpertRange(0, ROUTED // 2)), seed=0)
    kept = next(layer.mlp for layer in half.model.layers if layer.is_moe)
    assert kept.experts.stacked_shared == 0 and kept.experts.w13.shape[0] == ROUTED // 2
