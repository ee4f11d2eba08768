"""bf16 logits error against float32 on the same random weights: pdserve's GPU path next to transformers' own model.

For each init (pdserve's N(0, 1/fan_in), then a fixed small std like a trained checkpoint's scale): pdserve bf16
(flashinfer + grouped MoE) vs pdserve's float32 reference, then the same weights copied into transformers'
DeepseekV2ForCausalLM, run in bf16 and in float32. If transformers' bf16 error is as large as ours, the figure is
about bf16 on these weights, not about our kernels. One table last.

With --fp8, the config's linears are block-quantized and kept FP8 (as `--fp8-weights keep` serves an FP8
checkpoint): the FP8 model (FP8 GEMMs, activations rounded to FP8 per 128 columns) and the bf16 model of the same
weights dequantized, each against the float32 reference of those weights; no transformers comparison.

    python benchmarks/gpu_logits_error.py [--stds fan_in,0.006] [--tokens 512] [--fp8]
    python benchmarks/gpu_logits_error.py --device cpu --config TINY_DIR/config.json --tokens 16 --page-size 16
"""

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.model_steps import contiguous_batch, float32_reference_logits, step_inputs
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.block_fp8 import FP8_DTYPE, SCALE_SUFFIX, BlockFP8Weight
from pdserve.ops.select import Backends, select_backends

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def transformers_name(ours: str) -> str:
    return ours.replace("mlp.experts.w13", "mlp.experts.gate_up_proj").replace("mlp.experts.w2", "mlp.experts.down_proj")


def load_into_transformers(hf_model, ours) -> None:
    hf_params = dict(hf_model.named_parameters())
    copied = set()
    for name, param in ours.named_parameters():
        if name.endswith(("experts.w13", "experts.w2")):  # without the shared experts' stacked copies
            param = param[:ours.cfg.n_routed_experts]
        target = hf_params[transformers_name(name)]
        assert target.shape == param.shape, f"{name}: {tuple(param.shape)} vs {tuple(target.shape)}"
        target.data.copy_(param.data)
        copied.add(transformers_name(name))
    missing = set(hf_params) - copied
    assert not missing, f"transformers parameters left unset: {sorted(missing)[:5]}"


def dequantized_copy(model: DeepseekForCausalLM, backends: Backends) -> DeepseekForCausalLM:
    """The same weights with each FP8 one dequantized to bf16: the model `--fp8-weights dequantize` would load."""
    device = next(model.parameters()).device
    dense = build_model(model.cfg, backends, device, torch.bfloat16, model.expert_range)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in dense.named_parameters():
            source = params[name]
            if source.dtype == FP8_DTYPE:
                source = BlockFP8Weight(source, params[name + SCALE_SUFFIX], model.cfg.fp8_block_size).dequantize(
                    torch.bfloat16)
            param.copy_(source)
        for name, buffer in dense.named_buffers():
            source = model.get_buffer(name)
            if source is not None:  # None: a fused projection, which FP8 linears do not have; here it views the weights
                buffer.copy_(source)
    return dense


def fp8_logits_errors(cfg: ModelConfig, std: float | None, sequences: int, tokens: int, page_size: int,
                      device: torch.device) -> dict:
    """Last-position logits of `sequences` random prompts: FP8 and bf16 (same weights) against the float32 reference."""
    backends = select_backends("auto", "auto", device, torch.bfloat16)
    fp8 = init_random_weights(build_model(cfg, backends, device, torch.bfloat16, keep_fp8=True), seed=0, std=std)
    query_lens = [tokens] * sequences
    ids, positions, last_rows = step_inputs(query_lens, query_lens, cfg.vocab_size, device, seed=1)
    pages = -(-sequences * tokens // page_size) + 2

    def logits(model: DeepseekForCausalLM) -> torch.Tensor:
        kv = torch.zeros(cfg.num_hidden_layers, pages, page_size, cfg.kv_dim, dtype=torch.bfloat16, device=device)
        with torch.inference_mode():
            return model.compute_logits(model(ids, positions, kv, contiguous_batch(query_lens, query_lens, page_size,
                                                                                  device))[last_rows])

    fp8_logits = logits(fp8)
    reference = float32_reference_logits(fp8, ids, positions, contiguous_batch(query_lens, query_lens, page_size,
                                                                                device), last_rows)
    bf16 = dequantized_copy(fp8, backends)
    del fp8
    gc.collect()
    bf16_logits = logits(bf16)
    del bf16
    gc.collect()
    return dict(init="fan_in" if std is None else str(std), fp8=rel_err(fp8_logits, reference),
                bf16=rel_err(bf16_logits, reference),
                fp8_top1=(fp8_logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                bf16_top1=(bf16_logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                logit_std=reference.std().item())


def main_fp8(raw: dict, args: argparse.Namespace, device: torch.device) -> None:
    cfg = ModelConfig.from_dict({**raw, "quantization_config": raw.get("quantization_config") or FP8_QUANTIZATION})
    rows = []
    for std_name in args.stds.split(","):
        rows.append(fp8_logits_errors(cfg, None if std_name == "fan_in" else float(std_name), 2, args.tokens,
                                      args.page_size, device))
        print(rows[-1], flush=True)
    print()
    print("| init | FP8 vs float32 ref | bf16 (same weights) vs float32 ref | FP8 / bf16 | top-1 FP8 | top-1 bf16 "
          "| logit std |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['init']} | {r['fp8']:.2e} | {r['bf16']:.2e} | {r['fp8'] / r['bf16']:.1f} | {r['fp8_top1']:.2f} "
              f"| {r['bf16_top1']:.2f} | {r['logit_std']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--stds", default="fan_in,0.006")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence, 2 sequences")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fp8", action="store_true", help="FP8 weights against bf16 on the same weights (see above)")
    args = parser.parse_args()
    device = torch.device(args.device)
    raw = json.loads(Path(args.config).read_text())
    if args.fp8:  # needs no transformers
        print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
        main_fp8(raw, args, device)
        return
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    cfg = ModelConfig.from_dict(raw)
    hf_dir = Path(tempfile.mkdtemp())
    (hf_dir / "config.json").write_text(json.dumps(raw))
    hf_cfg = AutoConfig.from_pretrained(hf_dir)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, transformers {transformers.__version__}, torch {torch.__version__}")

    query_lens = [args.tokens] * 2
    ids, positions, last_rows = step_inputs(query_lens, query_lens, cfg.vocab_size, device, seed=1)
    rows = []
    for std_name in args.stds.split(","):
        std = None if std_name == "fan_in" else float(std_name)
        backends = select_backends("auto", "auto", device, torch.bfloat16)
        ours = init_random_weights(build_model(cfg, backends, device, torch.bfloat16), seed=0, std=std)
        pages = -(-2 * args.tokens // args.page_size) + 2
        kv = torch.zeros(cfg.num_hidden_layers, pages, args.page_size, cfg.kv_dim, dtype=torch.bfloat16, device=device)
        batch = contiguous_batch(query_lens, query_lens, args.page_size, device)
        with torch.inference_mode():
            ours_bf16 = ours.compute_logits(ours(ids, positions, kv, batch)[last_rows])
        reference = float32_reference_logits(ours, ids, positions, batch, last_rows)
        del kv

        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(hf_cfg, **{dtype_key: torch.bfloat16}).eval()
        load_into_transformers(hf, ours)
        del ours, backends
        gc.collect()
        hf_ids = ids.view(2, args.tokens)
        with torch.inference_mode():
            hf_bf16 = hf(input_ids=hf_ids).logits[:, -1].float()
            hf.float()
            hf_fp32 = hf(input_ids=hf_ids).logits[:, -1].float()
        del hf
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = dict(init=std_name, ours=rel_err(ours_bf16, reference), hf=rel_err(hf_bf16, hf_fp32),
                   ref_vs_hf=rel_err(reference, hf_fp32),
                   top1=(ours_bf16.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                   hf_top1=(hf_bf16.argmax(-1) == hf_fp32.argmax(-1)).float().mean().item(),
                   logit_std=reference.std().item())
        rows.append(row)
        print(row, flush=True)

    print()
    print("| init | pdserve bf16 vs float32 ref | transformers bf16 vs float32 | pdserve f32 ref vs transformers f32 "
          "| logit std |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['init']} | {r['ours']:.2e} | {r['hf']:.2e} | {r['ref_vs_hf']:.2e} | {r['logit_std']:.2f} |")


if __name__ == "__main__":
    main()
