"""The weight-memory report counts what a loaded rank holds."""

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.loader import load_model
from pdserve.model.tiny import make_tiny_model
from pdserve.model.weight_memory import rank_weight_bytes
from pdserve.ops.moe import ExpertRange
from pdserve.ops.select import select_backends


@pytest.mark.parametrize("keep_fp8", [True, False])
def test_rank_weight_bytes_equal_a_loaded_rank(tmp_path, keep_fp8):
    model_dir = make_tiny_model(tmp_path / "m", arch="v3", fp8=True,
                                overrides={"hidden_size": 160, "intermediate_size": 300, "moe_intermediate_size": 128})
    cfg = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    rank = load_model(model_dir, cfg, select_backends("torch", "torch", cpu, torch.bfloat16), cpu, torch.bfloat16,
                      experts=ExpertRange(4, 4), progress=False, keep_fp8=keep_fp8)
    counted = rank_weight_bytes(cfg, ranks=2, keep_fp8=keep_fp8)
    assert counted.routed_experts == rank.routed_expert_bytes()
    assert counted.total == sum(p.numel() * p.element_size() for p in rank.parameters())
