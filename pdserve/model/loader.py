"""Load a Hugging Face DeepSeek checkpoint (safetensors, single or sharded; bf16/fp32 or FP8 block-quantized)."""

import json
import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.block_fp8 import FP8_DTYPE, SCALE_SUFFIX, BlockFP8Weight
from pdserve.ops.moe import ExpertRange
from pdserve.ops.select import Backends

EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint does not match the config: a missing, extra or mis-shaped tensor (named in the message)."""


def build_model(
    cfg: ModelConfig, backends: Backends, device: torch.device, dtype: torch.dtype, experts: ExpertRange | None = None,
    keep_fp8: bool = False, fuse: bool = True,
) -> DeepseekForCausalLM:
    """An uninitialised model on `device` (no host copy of the weights is ever made). `keep_fp8`: an FP8 checkpoint's
    FP8 linears stay FP8 (values + scale grid) instead of being dequantized to `dtype`. `fuse`: linears that read the
    same input as one GEMM (benchmarks turn it off to measure it)."""
    fp8_block = cfg.fp8_block_size if keep_fp8 else None
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, backends, experts, fp8_block).to(dtype)
    # model.to_empty(device), but by torch.empty: empty_like of a meta tensor runs a Python reference that imports
    # sympy, ~1 s of every rank's start on the 2-core machine (the CPU never compiles anything that needs it).
    model._apply(lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device))
    if fuse:
        model.fuse_projections()
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
    keep_fp8: bool = False,
) -> DeepseekForCausalLM:
    model_dir = Path(model_dir)
    model = build_model(cfg, backends, device, dtype, experts, keep_fp8)
    params = model.state_dict(keep_vars=True)  # weights and persistent buffers (not the fused projections' views)
    # A kept FP8 weight's scale grid is filled with it, so only the weight itself is looked for.
    expected = {name for name in params if not name.endswith(SCALE_SUFFIX)}
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    experts_of = model.expert_range
    files = tensor_files(model_dir)
    filled: set[str] = set()
    fp8 = FP8Tally()
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt", device="cpu")) for f in set(files.values())}

        def read(name: str) -> torch.Tensor | BlockFP8Weight:
            tensor = handles[files[name]].get_tensor(name)
            if tensor.dtype != FP8_DTYPE:
                return tensor
            scale_name = name + SCALE_SUFFIX
            if cfg.fp8_block_size is None or scale_name not in files:
                raise CheckpointError(f"FP8 tensor {name} has no {scale_name} or config has no quantization_config")
            return BlockFP8Weight(tensor, handles[files[scale_name]].get_tensor(scale_name), cfg.fp8_block_size)

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
                    target_name, index = f"{prefix}.w2", (local,)
                else:
                    target_name = f"{prefix}.w13"
                    index = (local, slice(0, inter) if proj == "gate" else slice(inter, 2 * inter))
                _copy_into(params, target_name, read(name), name, fp8, index)
                filled.add(f"{target_name}[{local}].{proj}")
                continue
            if fused := FUSED_EXPERT_TENSOR.match(name):  # transformers 5 save format
                prefix = f"model.layers.{fused.group(1)}.mlp.experts"
                target_name = f"{prefix}.w13" if fused.group(2) == "gate_up_proj" else f"{prefix}.w2"
                if target_name not in params:
                    raise CheckpointError(f"unexpected tensor {name}: that layer has no routed experts")
                local_slice = read(name)[experts_of.first : experts_of.first + experts_of.count]
                _copy_into(params, target_name, local_slice, name, fp8)
                filled.add(target_name)
                continue
            if name not in params:
                raise CheckpointError(f"unexpected tensor {name} in {files[name].name}: the model has no such weight")
            _copy_into(params, name, read(name), name, fp8)
            filled.add(name)
    _check_complete(model, expected, filled)
    _log_fp8(model, fp8, dtype)
    model.finish_weights()
    return model


@dataclass
class FP8Tally:
    """FP8 values read from the checkpoint: kept FP8, or dequantized where the model holds the weight dense."""

    kept: int = 0
    dequantized: int = 0


def _copy_into(params: dict[str, torch.Tensor], target_name: str, source: torch.Tensor | BlockFP8Weight,
               source_name: str, fp8: FP8Tally, index: tuple[int | slice, ...] = ()) -> None:
    """Copies a checkpoint tensor into a parameter, or into `params[target_name][index]` of a stacked one (an
    expert, and gate's or up's rows of w13). A kept FP8 weight's scale grid goes to the same index in blocks."""
    target = params[target_name][index]
    if target.dtype == FP8_DTYPE:
        if not isinstance(source, BlockFP8Weight):
            raise CheckpointError(f"tensor {source_name} is stored as {source.dtype}, not FP8, but this model keeps "
                                  f"{target_name} in FP8 (load with --fp8-weights dequantize)")
        _copy_checked(target, source.values, target_name, source_name)
        block_rows = source.block_size[0]
        in_blocks = tuple(i if isinstance(i, int) else slice(i.start // block_rows, i.stop // block_rows) for i in index)
        scale_name = target_name + SCALE_SUFFIX
        _copy_checked(params[scale_name][in_blocks], source.scale_inv, scale_name, source_name + SCALE_SUFFIX)
        fp8.kept += source.values.numel()
        return
    if isinstance(source, BlockFP8Weight):
        fp8.dequantized += source.values.numel()
        source = source.dequantize()
    _copy_checked(target, source, target_name, source_name)


def _copy_checked(target: torch.Tensor, source: torch.Tensor, target_name: str, source_name: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise CheckpointError(
            f"tensor {source_name}: expected shape {tuple(target.shape)} for {target_name}, found {tuple(source.shape)}"
        )
    target.copy_(source.to(target.dtype))


def _log_fp8(model: DeepseekForCausalLM, fp8: FP8Tally, dtype: torch.dtype) -> None:
    """One line on what an FP8 checkpoint's weights became (one byte per FP8 value)."""
    kept, dequantized = fp8.kept, fp8.dequantized
    if not kept and not dequantized:
        return
    dtype_name = str(dtype).removeprefix("torch.")
    weight_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    if not kept:
        log.info("FP8 block-quantized checkpoint dequantized to %s on load (--fp8-weights dequantize, the CPU's "
                 "default): the %.1f GiB of FP8 weights read take %.1f GiB here; this rank's weights take %.1f GiB "
                 "in all", dtype_name, dequantized / 2**30, dequantized * dtype.itemsize / 2**30, weight_gib)
        return
    log.info("FP8 block-quantized checkpoint: %.1f GiB of weights kept in FP8 with their scales, %.2f GiB of FP8 "
             "dequantized to %s where the model needs another form (MLA's kv_b_proj; routed experts whose "
             "intermediate size is not whole blocks); this rank's weights take %.1f GiB in all",
             kept / 2**30, dequantized / 2**30, dtype_name, weight_gib)


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
