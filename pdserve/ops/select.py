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


def select_backends(attention: str, moe: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                    mla_widths: tuple[int, int] | None = None) -> Backends:
    """attention: auto | torch | flashinfer; moe: auto | torch | grouped. auto picks the GPU kernel when it can run.
    `mla_widths`: the model's latent and rotary key widths (kv_lora_rank, qk_rope_head_dim); None: DeepSeek's."""
    return Backends(attention=_attention(attention, device, dtype, mla_widths), moe=_moe(moe, device, dtype))


def _gpu_kernels_fit(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in GPU_KERNEL_DTYPES


def flashinfer_takes(mla_widths: tuple[int, int] | None) -> bool:
    """flashinfer's MLA kernels before Blackwell (fa2, fa3) take latent widths in multiples of 128 and rotary ones in
    multiples of 64, as DeepSeek's 512 + 64; a small test model's are narrower."""
    if mla_widths is None:
        return True
    latent, rotary = mla_widths
    return latent % 128 == 0 and rotary % 64 == 0


def _attention(name: str, device: torch.device, dtype: torch.dtype,
               mla_widths: tuple[int, int] | None) -> AttentionBackend:
    flashinfer_present = importlib.util.find_spec("flashinfer") is not None
    fits = _gpu_kernels_fit(device, dtype) and flashinfer_present and flashinfer_takes(mla_widths)
    if name == "auto":
        name = "flashinfer" if fits else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "flashinfer":
        if not fits:
            raise ValueError(f"attention backend flashinfer needs CUDA, bfloat16, the flashinfer package and MLA "
                             f"widths in multiples of 128 (latent) and 64 (rotary) (device={device}, dtype={dtype}, "
                             f"flashinfer installed={flashinfer_present}, widths={mla_widths})")
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
