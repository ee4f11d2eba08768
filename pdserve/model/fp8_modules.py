"""Modules holding block-FP8 weights as the checkpoint ships them: FP8 values and a float32 scale grid, the grid
named as the weight plus `_scale_inv` (as in the checkpoint), computed by pdserve.ops.fp8_gemm."""

import torch
from torch import nn

from pdserve.ops.block_fp8 import FP8_DTYPE, BlockFP8Weight, scale_grid_shape
from pdserve.ops.expert_placement import LayerPlacement, reserve_replica_slots
from pdserve.ops.fp8_gemm import block_fp8_linear
from pdserve.ops.moe import ExpertRange


def _fp8_parameters(shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[nn.Parameter, nn.Parameter]:
    values = torch.empty(shape, dtype=FP8_DTYPE)
    scale_inv = torch.empty(scale_grid_shape(shape, block_size), dtype=torch.float32)
    return nn.Parameter(values, requires_grad=False), nn.Parameter(scale_inv, requires_grad=False)


class KeepsFP8Dtypes(nn.Module):
    """Base of the modules below. A dtype cast (the model's `.to(bfloat16)` at build, `.float()` for a float32
    reference) would turn FP8 codes into plain numbers without their scales, and round the scales: these tensors
    keep their dtypes and only follow device moves. A float32 copy of a layer thus computes the reference product."""

    def _apply(self, fn, recurse=True):
        def move_only(tensor: torch.Tensor) -> torch.Tensor:
            applied = fn(tensor)
            return applied if applied.dtype == tensor.dtype else tensor.to(applied.device)

        return super()._apply(move_only, recurse)


class FP8Linear(KeepsFP8Dtypes):
    """A bias-free linear on a block-FP8 weight [out, in]."""

    def __init__(self, in_features: int, out_features: int, block_size: tuple[int, int]):
        super().__init__()
        self.block_size = block_size
        self.weight, self.weight_scale_inv = _fp8_parameters((out_features, in_features), block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_fp8_linear(x, BlockFP8Weight(self.weight, self.weight_scale_inv, self.block_size))


class FP8RoutedExperts(KeepsFP8Dtypes):
    """This rank's routed experts, stacked as RoutedExperts stacks them (w13 = gate rows then up rows), in FP8."""

    def __init__(self, hidden: int, inter: int, experts: ExpertRange, block_size: tuple[int, int]):
        super().__init__()
        if inter % block_size[0]:
            raise ValueError(f"stacking gate and up keeps their blocks only when moe_intermediate_size ({inter}) is a "
                             f"multiple of the block's rows ({block_size[0]})")
        self.experts = experts
        self.block_size = block_size
        self.w13, self.w13_scale_inv = _fp8_parameters((experts.count, 2 * inter, hidden), block_size)
        self.w2, self.w2_scale_inv = _fp8_parameters((experts.count, hidden, inter), block_size)
        self.placement: LayerPlacement | None = None  # replicas of other ranks' experts (reserve_replica_slots)

    def reserve_replica_slots(self, spare: int, rank: int, world_size: int) -> LayerPlacement:
        """Room for `spare` replicas after this rank's own experts, values and scale grids alike
        (expert_placement.reserve_replica_slots)."""
        self.placement = reserve_replica_slots(self, ("w13", "w13_scale_inv", "w2", "w2_scale_inv"), spare, rank,
                                               world_size)
        w13, w13_scale, w2, w2_scale = self.placement.slots
        self.placement.weights = (BlockFP8Weight(w13, w13_scale, self.block_size),
                                  BlockFP8Weight(w2, w2_scale, self.block_size))
        return self.placement

    def weights(self) -> tuple[BlockFP8Weight, BlockFP8Weight]:
        return (BlockFP8Weight(self.w13, self.w13_scale_inv, self.block_size),
                BlockFP8Weight(self.w2, self.w2_scale_inv, self.block_size))
