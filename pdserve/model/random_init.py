"""Random weights for a built model, generated where the model lives: benchmarks of real shapes need no checkpoint."""

import torch

from pdserve.model.deepseek import DeepseekForCausalLM


@torch.no_grad()
def init_random_weights(model: DeepseekForCausalLM, seed: int, std: float | None = None) -> DeepseekForCausalLM:
    """Matrices ~ N(0, 1/fan_in) so activations keep unit scale through the layers; norms 1, biases 0.
    With `std`, every matrix and the embedding ~ N(0, std) instead (a trained-checkpoint-like scale: each layer adds
    a small update to the residual stream rather than a unit-scale one)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("embed_tokens.weight"):
            param.normal_(0.0, 1.0 if std is None else std, generator=gen)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5 if std is None else std, generator=gen)  # last dim is fan-in for every matrix here
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.zero_()
    return model
