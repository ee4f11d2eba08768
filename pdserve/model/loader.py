"""Load a Hugging Face DeepSeek checkpoint (safetensors, single or sharded; bf16/fp32 or FP8 block-quantized)."""

import json
import logging
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.block_fp8 import dequantize_block_fp8
from pdserve.ops.moe import ExpertRange
from pdserve.ops.select import Backends

EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")
SCALE_SUFFIX = "_scale_inv"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint does not match the config: a missing, extra or mis-shaped tensor (named in the message)."""


def build_model(
    cfg: ModelConfig, backends: Backends, device: torch.device, dtype: torch.dtype, experts: ExpertRange | None = None
) -> DeepseekForCausalLM:
    """An uninitialised model on `device` (no host copy of the weights is ever made)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, backends, experts).to(dtype)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias = module.e_score_correction_bias.to(torch.float32)
    model.init_rope(device)
    return model.eval().requires_grad_(False)


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    return names


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    backends: Backends,
    device: torch.device,
    dtype: torch.dtype,
    experts: ExpertRange | None = None,
    progress: bool = True,
) -> DeepseekForCausalLM:
    model_dir = Path(model_dir)
    model = build_model(cfg, backends, device, dtype, experts)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    expected = set(params)
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    experts_of = model.expert_range
    files = tensor_files(model_dir)
    filled: set[str] = set()
    fp8_elements = 0
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt", device="cpu")) for f in set(files.values())}

        def read(name: str) -> torch.Tensor:
            nonlocal fp8_elements
            tensor = handles[files[name]].get_tensor(name)
            if tensor.dtype == torch.float8_e4m3fn:
                fp8_elements += tensor.numel()
                scale_name = name + SCALE_SUFFIX
                if cfg.fp8_block_size is None or scale_name not in files:
                    raise CheckpointError(f"FP8 tensor {name} has no {scale_name} or config has no quantization_config")
                tensor = dequantize_block_fp8(tensor, handles[files[scale_name]].get_tensor(scale_name), cfg.fp8_block_size)
            return tensor

        def copy_into(target_name: str, target: torch.Tensor, source: torch.Tensor, source_name: str) -> None:
            if tuple(target.shape) != tuple(source.shape):
                raise CheckpointError(
                    f"tensor {source_name}: expected shape {tuple(target.shape)} for {target_name}, "
                    f"found {tuple(source.shape)}"
                )
            target.copy_(source.to(target.dtype))

        names = [n for n in files if not n.endswith(SCALE_SUFFIX) and not n.endswith("rotary_emb.inv_freq")]
        for name in tqdm(names, desc="loading weights", unit="tensor", disable=not progress, leave=False):
            layer = LAYER_TENSOR.match(name)
            if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
                continue  # multi-token-prediction layers (V3) are not served
            if expert := EXPERT_TENSOR.match(name):
                layer_idx, expert_idx, proj = int(expert.group(1)), int(expert.group(2)), expert.group(3)
                if not experts_of.first <= expert_idx < experts_of.first + experts_of.count:
                    continue  # another rank's expert
                prefix = f"model.layers.{layer_idx}.mlp.experts"
                local, inter = expert_idx - experts_of.first, cfg.moe_intermediate_size
                if f"{prefix}.w13" not in params:
                    raise CheckpointError(f"unexpected tensor {name}: layer {layer_idx} has no routed experts")
                if proj == "down":
                    target_name, target = f"{prefix}.w2", params[f"{prefix}.w2"][local]
                else:
                    rows = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
                    target_name, target = f"{prefix}.w13", params[f"{prefix}.w13"][local, rows]
                copy_into(target_name, target, read(name), name)
                filled.add(f"{target_name}[{local}].{proj}")
                continue
            if fused := FUSED_EXPERT_TENSOR.match(name):  # transformers 5 save format
                prefix = f"model.layers.{fused.group(1)}.mlp.experts"
                target_name = f"{prefix}.w13" if fused.group(2) == "gate_up_proj" else f"{prefix}.w2"
                if target_name not in params:
                    raise CheckpointError(f"unexpected tensor {name}: that layer has no routed experts")
                local_slice = read(name)[experts_of.first : experts_of.first + experts_of.count]
                copy_into(target_name, params[target_name], local_slice, name)
                filled.add(target_name)
                continue
            if name not in params:
                raise CheckpointError(f"unexpected tensor {name} in {files[name].name}: the model has no such weight")
            copy_into(name, params[name], read(name), name)
            filled.add(name)
    _check_complete(model, expected, filled)
    if fp8_elements:
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info("FP8 block-quantized checkpoint dequantized to %s on load (no FP8 GEMMs yet): the %.1f GiB of FP8 "
                 "weights read take %.1f GiB here; this rank's weights take %.1f GiB in all", str(dtype).removeprefix(
                     "torch."), fp8_elements / 2**30, fp8_elements * dtype.itemsize / 2**30, weight_bytes / 2**30)
    return model


def _check_complete(model: DeepseekForCausalLM, expected: set[str], filled: set[str]) -> None:
    missing = []
    for name in sorted(expected):
        if name.endswith(("experts.w13", "experts.w2")):
            if name in filled:
                continue
            projs = ("gate", "up") if name.endswith("w13") else ("down",)
            prefix = name.rsplit(".", 1)[0]
            for local in range(model.expert_range.count):
                for proj in projs:
                    if f"{name}[{local}].{proj}" not in filled:
                        missing.append(f"{prefix}.{model.expert_range.first + local}.{proj}_proj.weight")
        elif name not in filled:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
