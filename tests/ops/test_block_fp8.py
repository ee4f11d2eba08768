import pytest
import torch

from pdserve.ops.block_fp8 import FP8_DTYPE, FP8_MAX, BlockFP8Weight, dequantize_block_fp8, quantize_block_fp8


def _dequantize_block_by_block(weight_fp8, scale_inv, block_size):
    """Slow twin: one block at a time, no broadcasting tricks."""
    out = torch.empty(weight_fp8.shape, dtype=torch.float32)
    for block_row in range(scale_inv.shape[0]):
        for block_col in range(scale_inv.shape[1]):
            rows = slice(block_row * block_size[0], (block_row + 1) * block_size[0])
            cols = slice(block_col * block_size[1], (block_col + 1) * block_size[1])
            out[rows, cols] = weight_fp8[rows, cols].float() * scale_inv[block_row, block_col]
    return out


@pytest.mark.parametrize("shape", [(300, 160), (128, 128), (5, 7), (257, 129)])
def test_dequantize_matches_block_by_block_twin(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    weight_fp8, scale_inv = quantize_block_fp8(weight, (128, 128))
    assert weight_fp8.dtype == FP8_DTYPE
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    fast = dequantize_block_fp8(weight_fp8, scale_inv, (128, 128))
    assert torch.equal(fast, _dequantize_block_by_block(weight_fp8, scale_inv, (128, 128)))
    assert (fast - weight).norm() / weight.norm() < 0.05


def test_each_block_uses_full_fp8_range_and_zero_block_stays_zero():
    weight = torch.zeros(256, 128)
    weight[:128] = torch.linspace(-2, 5, 128 * 128).view(128, 128)
    weight_fp8, scale_inv = quantize_block_fp8(weight)
    assert weight_fp8[:128].float().abs().max() == FP8_MAX
    assert scale_inv[0, 0] == pytest.approx(5 / FP8_MAX)
    assert torch.equal(dequantize_block_fp8(weight_fp8, scale_inv)[128:], torch.zeros(128, 128))


def test_wrong_scale_grid_is_rejected():
    weight_fp8, scale_inv = quantize_block_fp8(torch.randn(200, 200))
    with pytest.raises(ValueError, match="scale_inv grid"):
        dequantize_block_fp8(weight_fp8, scale_inv[:1])


def test_stacked_experts_quantize_each_expert_alone():
    experts = torch.randn(3, 300, 160, generator=torch.Generator().manual_seed(1))
    values, scale_inv = quantize_block_fp8(experts)
    assert values.shape == (3, 300, 160) and scale_inv.shape == (3, 3, 2)
    for expert in range(3):
        alone_values, alone_scale = quantize_block_fp8(experts[expert])
        assert torch.equal(values[expert].view(torch.uint8), alone_values.view(torch.uint8))
        assert torch.equal(scale_inv[expert], alone_scale)
    weight = BlockFP8Weight(values, scale_inv, (128, 128))
    assert weight.shape == (3, 300, 160) and weight[1].shape == (300, 160)
    assert torch.equal(weight[1].dequantize(), dequantize_block_fp8(values[1], scale_inv[1]))
    assert torch.equal(weight.dequantize()[2], weight[2].dequantize())
