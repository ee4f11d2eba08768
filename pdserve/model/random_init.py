"""Random weights for a built model, generated where the model lives: benchmarks of real shapes need no checkpoint."""

import torch

from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.block_fp8 import FP8_DTYPE, SCALE_SUFFIX, quantize_block_fp8


@torch.no_grad()
def init_random_weights(model: DeepseekForCausalLM, seed: int, std: float | None = None) -> DeepseekForCausalLM:
    """Matrices ~ N(0, 1/fan_in) so activations keep unit scale through the layers; norms 1, biases 0.
    With `std`, every matrix and the embedding ~ N(0, std) instead (a trained-checkpoint-like scale: each layer adds
    a small update to the residual stream rather than a unit-scale one). FP8 weights are drawn the same way, then
    block-quantized as a checkpoint's are."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, param in params.items():
        fan_in_std = param.shape[-1] ** -0.5 if std is None else std  # last dim is fan-in for every matrix here
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("embed_tokens.weight"):
            param.normal_(0.0, 1.0 if std is None else std, generator=gen)
        elif param.dtype == FP8_DTYPE:
            _fill_fp8(param, params[name + SCALE_SUFFIX], model.cfg.fp8_block_size, fan_in_std, gen)
        elif not name.endswith(SCALE_SUFFIX):
            param.normal_(0.0, fan_in_std, generator=gen)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.zero_()
    model.finish_weights()
    return model


def _fill_fp8(values: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int], std: float,
              gen: torch.Generator) -> None:
    # One expert at a time (or the whole matrix): a float32 draw of a layer's experts would be 4x their FP8 bytes.
    parts = range(values.shape[0]) if values.dim() == 3 else [...]
    for index in parts:
        draw = torch.empty(values[index].shape, dtype=torch.float32, device=values.device).normal_(0.0, std, generator=gen)
        values[index], scale_inv[index] = quantize_block_fp8(draw, block_size)
