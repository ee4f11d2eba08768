"""Drives a ModelRunner through steps given as {request id: tokens this step}, as the engine would schedule them:
for comparing two runners step by step on the same requests."""

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.wire.sampling import SamplingParams

PAGE_SIZE = 4


def request_of(request_id: str, prompt_len: int, first_page: int, seed: int) -> Request:
    """A request owning 16 pages from `first_page` on (64 tokens)."""
    prompt = torch.randint(2, 400, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    pages = list(range(first_page, first_page + 16))
    return Request(request_id, prompt, SamplingParams(max_tokens=8), torch.Generator(), page_ids=pages)


def run_step(runner: ModelRunner, requests: dict[str, Request], step: dict[str, int]) -> torch.Tensor:
    """One step's logits; then each sampling row's next token is 7, so that two runners' steps stay the same."""
    scheduled = [ScheduledSeq(requests[rid], n) for rid, n in step.items()]
    logits = runner.execute(scheduled)
    for seq in scheduled:
        if seq.samples:
            seq.request.output_token_ids.append(7)
        seq.request.num_computed_tokens += seq.num_new_tokens
    return logits
