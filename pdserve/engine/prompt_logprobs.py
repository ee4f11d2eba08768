"""The log-probabilities of prompt tokens (OpenAI's `echo` with `logprobs`): each prompt position's hidden state
predicts the next prompt token. Computed a few hundred rows at a time, so a long prompt never holds its whole
[tokens, vocab] logits at once."""

from dataclasses import dataclass

import torch

from pdserve.engine.request import PromptTokenLogprobs, Request
from pdserve.model.deepseek import DeepseekForCausalLM

ROWS_PER_CHUNK = 256  # 256 x 129k float32 logits: 132 MB at a time


@dataclass
class PromptRows:
    """Where, in one step's flattened tokens, positions whose next token is a prompt token sit."""

    rows: list[int]  # indices into the step's hidden states
    requests: list[Request]
    positions: list[int]  # each row's position in its request's prompt

    def add(self, request: Request, first_row: int, start: int, end: int) -> None:
        """A chunk of `request` computing positions [start, end) from row `first_row` on."""
        last = min(end, len(request.prompt_token_ids) - 1)  # the last prompt position predicts the first output
        for position in range(start, last):
            self.rows.append(first_row + position - start)
            self.requests.append(request)
            self.positions.append(position)


def compute_prompt_logprobs(model: DeepseekForCausalLM, hidden: torch.Tensor, prompt: PromptRows) -> None:
    """Fill each listed request's `prompt_logprobs` at position + 1: the model's own log-softmax (no temperature, bias
    or penalties), as OpenAI's and the output tokens' log-probabilities are."""
    top_n = max(request.sampling.prompt_logprobs or 0 for request in prompt.requests)
    for chunk in range(0, len(prompt.rows), ROWS_PER_CHUNK):
        rows = slice(chunk, chunk + ROWS_PER_CHUNK)
        requests, positions = prompt.requests[rows], prompt.positions[rows]
        row_index = torch.tensor(prompt.rows[rows], device=hidden.device)
        targets = torch.tensor([r.prompt_token_ids[p + 1] for r, p in zip(requests, positions)], device=hidden.device)
        logprobs = torch.log_softmax(model.compute_logits(hidden[row_index]), dim=-1)
        chosen_values = logprobs.gather(1, targets[:, None])
        ranks = ((logprobs > chosen_values).sum(dim=-1) + 1).tolist()
        chosen = chosen_values[:, 0].tolist()
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0], logprobs[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for i, (request, position) in enumerate(zip(requests, positions)):
            n = request.sampling.prompt_logprobs or 0
            request.prompt_logprobs[position + 1] = PromptTokenLogprobs(chosen[i], ranks[i], top_ids[i][:n],
                                                                        top_values[i][:n])
