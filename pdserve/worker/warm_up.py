"""A rank's warm-up: every kernel variant it will run, through its engine, before it reports ready (a first prefill
once spent 80 s compiling a kernel on the step thread while the worker was already taking traffic)."""

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Callable

from pdserve.engine.engine import Engine
from pdserve.wire.protocol import GenerateRequest, TokenEvent
from pdserve.wire.sampling import SamplingParams

CPU_WARMUP_TOKENS = 128  # nothing compiles on the CPU: a short prompt walks the same code


async def warm_up(engine: Engine, rank: int,
                  generate: Callable[[GenerateRequest], AsyncIterator[TokenEvent]]) -> None:
    """A full chunk (the expanded attention form), the same prompt again (a short chunk over a cached prefix: the
    absorbed form) beside a short sampled prompt (mixed steps, the sampler), each with a few decode steps (CUDA
    graph replays)."""
    chunk = engine.cfg.max_num_batched_tokens
    if engine.device.type == "cpu":
        chunk = min(chunk, CPU_WARMUP_TOKENS)
    chunk = max(2, min(chunk, engine.max_model_len - 8))
    draw = random.Random(rank)
    vocab = engine.model_config.vocab_size
    long_prompt = [draw.randrange(vocab) for _ in range(chunk)]
    short_prompt = [draw.randrange(vocab) for _ in range(17)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, top_k=5, seed=0, ignore_eos=True)

    async def run(name: str, prompt: list[int], sampling: SamplingParams) -> None:
        async for event in generate(GenerateRequest(f"warmup-{name}-{uuid.uuid4().hex[:8]}", rank, prompt, sampling)):
            if event.finish_reason == "error":
                raise RuntimeError(f"rank {rank} warm-up failed: {event.error}")

    await run("long", long_prompt, greedy)
    await asyncio.gather(run("again", long_prompt, greedy), run("short", short_prompt, sampled))
