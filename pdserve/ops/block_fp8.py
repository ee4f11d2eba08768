"""DeepSeek-V3 block-wise FP8 weights: float8_e4m3fn values with one float32 `weight_scale_inv` per block.

A weight of shape [..., out, in] has a scale grid of [..., ceil(out / block_out), ceil(in / block_in)] (leading dims
stack experts); edge blocks are partial. Dequantized weight = fp8 value as float32 * the scale of its block.
"""

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448 for e4m3fn
DEFAULT_BLOCK_SIZE = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # a weight's scale grid is stored (and held) under the weight's name + this


def scale_grid_shape(weight_shape: torch.Size | tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, ...]:
    *leading, rows, cols = weight_shape
    return (*leading, -(-rows // block_size[0]), -(-cols // block_size[1]))


def _expand_scales(scale_inv: torch.Tensor, weight_shape: torch.Size, block_size: tuple[int, int]) -> torch.Tensor:
    """Broadcasts one scale per block to one scale per element, cropping the partial edge blocks."""
    rows, cols = weight_shape[-2:]
    expanded = scale_inv.repeat_interleave(block_size[0], dim=-2).repeat_interleave(block_size[1], dim=-1)
    return expanded[..., :rows, :cols]


def quantize_block_fp8(
    weight: torch.Tensor, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (fp8 weight, float32 scale_inv grid); each block's largest magnitude maps to FP8_MAX."""
    if weight.dim() < 2:
        raise ValueError(f"block fp8 quantizes [..., rows, cols] weights, got shape {tuple(weight.shape)}")
    weight = weight.float()
    *leading, grid_rows, grid_cols = scale_grid_shape(weight.shape, block_size)
    padded = weight.new_zeros(*leading, grid_rows * block_size[0], grid_cols * block_size[1])
    padded[..., : weight.shape[-2], : weight.shape[-1]] = weight
    blocks = padded.view(*leading, grid_rows, block_size[0], grid_cols, block_size[1])
    block_amax = blocks.abs().amax(dim=(-3, -1))
    # An all-zero block would give a zero scale; any positive scale represents it exactly.
    scale_inv = torch.where(block_amax > 0, block_amax / FP8_MAX, torch.ones_like(block_amax))
    scaled = weight / _expand_scales(scale_inv, weight.shape, block_size)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale_inv


def dequantize_block_fp8(
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    expected_grid = scale_grid_shape(weight_fp8.shape, block_size)
    if tuple(scale_inv.shape) != expected_grid:
        raise ValueError(
            f"scale_inv grid for weight {tuple(weight_fp8.shape)} with blocks {block_size} should be "
            f"{expected_grid}, got {tuple(scale_inv.shape)}"
        )
    dequantized = weight_fp8.float() * _expand_scales(scale_inv.float(), weight_fp8.shape, block_size)
    return dequantized.to(dtype)


@dataclass(frozen=True, slots=True)
class BlockFP8Weight:
    """A weight kept as the checkpoint ships it: FP8 values [..., out, in] and their float32 scale grid. `shape` is the
    values' shape, so code that only reads a weight's shape (how many experts) takes either form; indexing picks
    along the leading (expert) dim."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    block_size: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def __getitem__(self, index: int | slice) -> "BlockFP8Weight":
        if self.values.dim() < 3:
            raise IndexError("only stacked [experts, out, in] FP8 weights are indexed")
        return BlockFP8Weight(self.values[index], self.scale_inv[index], self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_block_fp8(self.values, self.scale_inv, self.block_size, dtype)
