"""What a rank's weights take in memory, from the config alone: the model is built on the meta device (no bytes
allocated) exactly as a rank would build it, so FP8 scale grids and the tensors that stay dense are counted."""

from dataclasses import dataclass

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.attention import TorchAttention
from pdserve.ops.moe import ExpertRange, TorchMoE
from pdserve.ops.select import Backends


@dataclass(frozen=True)
class RankWeightBytes:
    replicated: int  # embeddings, attention, dense and shared-expert MLPs, norms, routers: on every rank
    routed_experts: int  # this rank's share of the routed experts

    @property
    def total(self) -> int:
        return self.replicated + self.routed_experts


def rank_weight_bytes(cfg: ModelConfig, ranks: int, keep_fp8: bool, dtype: torch.dtype = torch.bfloat16
                      ) -> RankWeightBytes:
    """One rank of `ranks` expert-parallel ranks (each holding n_routed_experts / ranks experts); `keep_fp8` as the
    loader's (the FP8 linears of an FP8 config stay FP8), everything else in `dtype`."""
    if cfg.n_routed_experts % ranks:
        raise ValueError(f"{cfg.n_routed_experts} routed experts do not split evenly over {ranks} ranks")
    fp8_block = cfg.fp8_block_size if keep_fp8 else None
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, Backends(TorchAttention(), TorchMoE()),
                                    ExpertRange(0, cfg.n_routed_experts // ranks), fp8_block).to(dtype)
        model.finish_weights()  # as loading does
    routed = model.routed_expert_bytes()
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    return RankWeightBytes(replicated=every - routed, routed_experts=routed)
