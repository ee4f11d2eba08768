"""The decoder layers' own tensor work compiled by inductor (torch.compile): the regions between the attention and
expert kernels, and the grouped routed experts' glue. Captured inside the decode CUDA graphs, and run by the steps
outside them (prefill chunks, mixed steps) unless the engine is told otherwise; compiled on first use, once for every
layer and token count (1 aside; the MoE layers' regions once each side of pdserve.model.deepseek's few-token limits,
the experts once each side of their counting sort's limit, pdserve.ops.moe_grouped)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.model.deepseek import DeepseekForCausalLM, LayerRegions, attention_inputs, attention_output, mlp_output
from pdserve.model.fp8_modules import FP8Linear
from pdserve.ops.moe import MoEBackend
from pdserve.ops.moe_ep import CompiledExpertParallelMoE, ExpertParallelMoE
from pdserve.ops.moe_grouped import CompiledGroupedMoE, GroupedMoE
from pdserve.ops.token_dynamic import compile_token_dynamic


@dataclass(frozen=True)
class CompiledLayers:
    regions: LayerRegions
    moe: MoEBackend  # grouped experts compiled, the exchange between ranks with its tensor work compiled, or as is


def compile_layers(model: DeepseekForCausalLM, backend: str | Callable = "inductor") -> CompiledLayers:
    """`backend`: torch.compile's; inductor generates the fused kernels (tests trace with others, which is fast)."""
    regions = LayerRegions(*(compile_token_dynamic(fn, backend) for fn in (attention_inputs, attention_output,
                                                                            mlp_output)))
    moe = model.backends.moe
    if isinstance(moe, GroupedMoE):
        moe = CompiledGroupedMoE.build(backend)
    elif isinstance(moe, ExpertParallelMoE):
        moe = CompiledExpertParallelMoE.build(moe, backend)
    return CompiledLayers(regions, moe)


def wants_compiled_layers(setting: str, model: DeepseekForCausalLM) -> bool:
    """`setting`: on | off | auto. auto: on for bf16 models on CUDA whose linears are not kept FP8 (the FP8 GEMMs were
    not measured inside compiled regions)."""
    if setting != "auto":
        return setting == "on"
    param = next(model.parameters())
    has_fp8 = any(isinstance(module, FP8Linear) for module in model.modules())
    return param.device.type == "cuda" and param.dtype == torch.bfloat16 and not has_fp8
