"""The vectorized penalties and logit bias equal a straightforward per-row, per-token reference on random input."""

import random

import pytest
import torch

from pdserve.engine.penalties import apply_logit_bias, apply_penalties
from pdserve.wire.sampling import SamplingParams

VOCAB = 37


def reference(logits: torch.Tensor, params, prompts, outputs, biases) -> torch.Tensor:
    """One row and one token at a time, as the conventions read."""
    result = logits.clone()
    for row in range(logits.shape[0]):
        for token_id, bias in biases[row].items():
            result[row, token_id] += bias
        p = params[row]
        for token_id in range(VOCAB):
            count = outputs[row].count(token_id)
            value = result[row, token_id].item()
            if p.repetition_penalty != 1.0 and (count or token_id in prompts[row]):
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            value -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
            result[row, token_id] = value
    return result


def random_case(seed: int):
    rng = random.Random(seed)
    batch_size = rng.randint(1, 6)
    params, prompts, outputs, biases = [], [], [], []
    for _ in range(batch_size):
        penalized = rng.random() < 0.7
        params.append(SamplingParams(
            presence_penalty=rng.uniform(-2, 2) if penalized else 0.0,
            frequency_penalty=rng.uniform(-2, 2) if penalized and rng.random() < 0.7 else 0.0,
            repetition_penalty=rng.uniform(0.5, 2.0) if penalized and rng.random() < 0.5 else 1.0,
        ))
        prompts.append([rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))])
        outputs.append([rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))])
        biases.append({rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))})
    logits = torch.randn(batch_size, VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    return logits, params, prompts, outputs, biases


@pytest.mark.parametrize("seed", range(40))
def test_vectorized_bias_and_penalties_equal_the_per_row_reference(seed):
    logits, params, prompts, outputs, biases = random_case(seed)
    fast = logits.clone()
    apply_logit_bias(fast, biases)
    apply_penalties(fast, params, prompts, outputs)
    assert torch.allclose(fast, reference(logits, params, prompts, outputs, biases), atol=1e-4)


def test_unpenalized_rows_are_untouched():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams()]
    apply_penalties(logits, params, [[1], [1], [1]], [[2, 2], [2, 2], [2, 2]])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert logits[1, 2].item() == pytest.approx(before[1, 2].item() - 2.0)
