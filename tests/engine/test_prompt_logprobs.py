"""Prompt log-probabilities agree with the output's: a greedy continuation's tokens, sent back as part of a prompt,
get the log-probabilities they had when they were generated (prefill rows against decode steps). On CUDA this runs
the served path (bf16, flashinfer, CUDA graphs, compiled steps), where the two paths round differently."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.engine.test_cuda_graphs import FLASHINFER_SHAPE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check_continuation_scored_as_generated(model: str, tolerance: float, **options) -> None:
    """`tolerance`: the most the two paths' log-probabilities may differ by."""
    llm = LLM(model, progress=False, **options)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, 400, (90,), generator=gen).tolist()
    made = llm.generate(prompt_token_ids=[prompt], sampling=SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    scored = llm.generate(prompt_token_ids=[prompt + made.token_ids], sampling=SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1))[0]
    assert len(scored.prompt_logprobs) == len(prompt) + 12 and scored.prompt_logprobs[0] is None
    continuation = scored.prompt_logprobs[len(prompt):]
    assert [p.logprob for p in continuation] == pytest.approx(made.logprobs, abs=tolerance)
    # a rank and the alternatives come from one distribution: rank 1 exactly where the token is the first alternative
    assert all((p.rank == 1) == (p.top_token_ids[0] == token) for p, token in zip(continuation, made.token_ids))
    # greedy tokens were each the most likely one (or within the tolerance of it, where the paths round apart)
    assert all(p.top_token_ids[0] == token or p.top_logprobs[0] - p.logprob <= 2 * tolerance
               for p, token in zip(continuation, made.token_ids))


def test_a_continuation_is_scored_as_it_was_generated(tiny_v2):
    check_continuation_scored_as_generated(tiny_v2, 1e-4, dtype="float32")


@pytest.mark.gpu
@needs_cuda
def test_a_continuation_is_scored_as_it_was_generated_on_cuda(tiny_model_factory):
    # bf16 logits (the head's matmul rounds them) differ between the prefill and decode kernels by up to ~0.1 (0.082
    # measured on an H200); a wrong position would be off by whole units
    check_continuation_scored_as_generated(tiny_model_factory("v2", **FLASHINFER_SHAPE), 0.15, device="cuda",
                                           dtype="bfloat16", cuda_graphs=True, max_num_seqs=8)
