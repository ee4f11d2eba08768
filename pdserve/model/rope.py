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
        """cos and sin of position * freq, already multiplied by YaRN's attention factor: [T, 2, dim/2] float32.
        Real arithmetic, not complex: the compiled decode regions fuse it into the projections' epilogue (inductor
        generates no code for complex operators)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.stack((freqs.cos(), freqs.sin()), dim=1) * self.scale

    def apply(self, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, ..., dim] in float32; rotations [T, 2, dim/2] broadcast over the middle dims. A pair (a, b)
        becomes (a cos - b sin, a sin + b cos): adjacent dims when interleaved, else the two halves."""
        shape = (rotations.shape[0],) + (1,) * (x.dim() - 2) + (rotations.shape[2],)
        cos, sin = rotations[:, 0].view(shape), rotations[:, 1].view(shape)
        xf = x.to(torch.float32)
        if self.cfg.interleave:
            a, b = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            a, b = xf[..., :half], xf[..., half:]
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return out.to(x.dtype)
