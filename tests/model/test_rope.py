"""Rotary embedding in float32 against the cos/sin rotation in float64, in both pair layouts."""

import pytest
import torch

from pdserve.model.config import RopeConfig
from pdserve.model.rope import RotaryEmbedding


def written_out(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, interleave: bool) -> torch.Tensor:
    angles = (positions.float()[:, None] * rope.inv_freq[None, :]).double()  # float32 angles, as the models define them
    cos, sin = (angles.cos() * rope.scale)[:, None, :], (angles.sin() * rope.scale)[:, None, :]
    x = x.double()
    if interleave:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


@pytest.mark.parametrize("interleave", [True, False])
def test_rotation_equals_the_float64_formula(interleave):
    cfg = RopeConfig(theta=10000.0, dim=64, kind="yarn", interleave=interleave, factor=40.0,
                     original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                     mscale_all_dim=0.707)
    rope = RotaryEmbedding(cfg, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 4095, 100_000])
    q = torch.randn(5, 3, 192, generator=torch.Generator().manual_seed(0))[..., 128:]  # a strided slice, as in MLA
    out = rope.apply(q, rope.rotations(positions))
    torch.testing.assert_close(out.double(), written_out(q, positions, rope, interleave), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(out[1:], q[1:])  # something did rotate
