"""Logit bias and the presence, frequency and repetition penalties, applied in place to a batch's logits [B, V],
vectorized over the rows that use them (token counts by one scatter-add over padded token lists).

Conventions: OpenAI's for presence and frequency (output tokens only: `logit -= frequency * count + presence *
[count > 0]`); Hugging Face's / vLLM's for repetition (prompt and output tokens: positive logits divided by the
penalty, negative ones multiplied)."""

from collections.abc import Sequence

import torch

from pdserve.engine.device_values import on_device
from pdserve.wire.sampling import SamplingParams


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float]]) -> None:
    rows = [row for row, bias in enumerate(biases) for _ in bias]
    if not rows:
        return
    device = logits.device
    cols = [token_id for bias in biases for token_id in bias]
    values = [value for bias in biases for value in bias.values()]
    logits.index_put_((on_device(rows, device), on_device(cols, device)), on_device(values, device, logits.dtype),
                      accumulate=True)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]]) -> None:
    rows = [row for row, row_params in enumerate(params) if row_params.penalized]
    if not rows:
        return
    device, vocab_size = logits.device, logits.shape[1]
    index = on_device(rows, device)
    output_counts = token_counts([own_output(prompt_token_ids[row], output_token_ids[row], params[row]) for row in rows],
                                 vocab_size, device)
    selected = logits[index]
    repetitions = [params[row].repetition_penalty for row in rows]
    if any(penalty != 1.0 for penalty in repetitions):
        repetition = on_device(repetitions, device, torch.float32)
        seen = (output_counts > 0) | (token_counts([prompt_token_ids[row] for row in rows], vocab_size, device) > 0)
        penalty = torch.where(seen, repetition[:, None], torch.ones_like(repetition)[:, None])
        selected = torch.where(selected > 0, selected / penalty, selected * penalty)
    frequency = on_device([params[row].frequency_penalty for row in rows], device, torch.float32)
    presence = on_device([params[row].presence_penalty for row in rows], device, torch.float32)
    selected = selected - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0)
    logits[index] = selected.to(logits.dtype)


def own_output(prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
               params: SamplingParams) -> Sequence[int]:
    """The request's output; a migrated stream's began at the end of its prompt (`continued_tokens`)."""
    if not params.continued_tokens:
        return output_token_ids
    return [*prompt_token_ids[len(prompt_token_ids) - params.continued_tokens:], *output_token_ids]


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] float32: how often each token id occurs in each list."""
    longest = max(1, max(len(tokens) for tokens in token_lists))
    padded = torch.full((len(token_lists), longest), vocab_size, dtype=torch.long)  # the pad column is dropped
    for row, tokens in enumerate(token_lists):
        padded[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    padded = padded.to(device, non_blocking=True)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]
