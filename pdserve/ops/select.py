"""Picks the attention and MoE backends for a device: GPU kernels on CUDA when present, torch references otherwise."""

import importlib.util
from dataclasses import dataclass

import torch

from pdserve.ops.attention import AttentionBackend, TorchAttention
from pdserve.ops.expert_load import ExpertLoad
from pdserve.ops.moe import MoEBackend, TorchMoE


@dataclass(frozen=True)
class Backends:
    """The kernels a model runs on: one attention and one MoE backend, and where routed pairs are counted."""

    attention: AttentionBackend
    moe: MoEBackend
    expert_load: ExpertLoad | None = None


GPU_KERNEL_DTYPES = (torch.bfloat16,)  # flashinfer MLA and torch._grouped_mm run in bf16, not float32


def select_backends(attention: str, moe: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Backends:
    """attention: auto | torch | flashinfer; moe: auto | torch | grouped. auto picks the GPU kernel when it can run."""
    return Backends(attention=_attention(attention, device, dtype), moe=_moe(moe, device, dtype))


def _gpu_kernels_fit(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in GPU_KERNEL_DTYPES


def _attention(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    flashinfer_present = importlib.util.find_spec("flashinfer") is not None
    if name == "auto":
        name = "flashinfer" if _gpu_kernels_fit(device, dtype) and flashinfer_present else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "flashinfer":
        if not _gpu_kernels_fit(device, dtype) or not flashinfer_present:
            raise ValueError(f"attention backend flashinfer needs CUDA, bfloat16 and the flashinfer package "
                             f"(device={device}, dtype={dtype}, flashinfer installed={flashinfer_present})")
        from pdserve.ops.attention_flashinfer import FlashInferMLA

        return FlashInferMLA(device)
    raise ValueError(f"unknown attention backend {name!r}: expected auto, torch or flashinfer")


def _moe(name: str, device: torch.device, dtype: torch.dtype) -> MoEBackend:
    if name == "auto":
        name = "grouped" if _gpu_kernels_fit(device, dtype) else "torch"
    if name == "torch":
        return TorchMoE()
    if name == "grouped":
        if dtype != torch.bfloat16:
            raise ValueError(f"moe backend grouped runs in bfloat16 only, got dtype={dtype}")
        from pdserve.ops.moe_grouped import GroupedMoE

        return GroupedMoE()
    raise ValueError(f"unknown moe backend {name!r}: expected auto, torch or grouped")
