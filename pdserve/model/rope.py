"""Decoupled rotary embedding of MLA's rope dims, with YaRN frequency scaling (as DeepSeek and transformers do it)."""

import math

import torch

from pdserve.model.config import RopeConfig


def rope_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [dim/2], float32; YaRN blends interpolated and extrapolated ones by a linear ramp."""
    exponents = torch.arange(0, cfg.dim, 2, dtype=torch.float32) / cfg.dim
    pos_freqs = cfg.theta**exponents
    if cfg.kind == "default":
        return 1.0 / pos_freqs

    def correction_dim(num_rotations: float) -> float:
        ratio = cfg.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return cfg.dim * math.log(ratio) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, cfg.dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(cfg.dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return (1.0 / (cfg.factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight


class RotaryEmbedding:
    def __init__(self, cfg: RopeConfig, device: torch.device):
        self.cfg = cfg
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.scale = cfg.attention_factor

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """e^(i * position * freq), already multiplied by YaRN's attention factor: [T, dim/2] complex64. Rotating a
        pair of dims is one complex multiply, a single kernel on the GPU where cos/sin arithmetic takes eight."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.polar(torch.full_like(freqs, self.scale), freqs)

    def apply(self, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, ..., dim] in float32; rotations [T, dim/2] broadcast over the middle dims."""
        rotations = rotations.view((rotations.shape[0],) + (1,) * (x.dim() - 2) + (rotations.shape[1],))
        xf = x.to(torch.float32)
        if self.cfg.interleave:
            pairs = torch.view_as_complex(xf.unflatten(-1, (-1, 2)).contiguous())
            out = torch.view_as_real(pairs * rotations).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            rotated = torch.complex(xf[..., :half], xf[..., half:]) * rotations
            out = torch.cat((rotated.real, rotated.imag), dim=-1)
        return out.to(x.dtype)
