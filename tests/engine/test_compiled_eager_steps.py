"""Steps outside the decode graphs (prefill chunks, mixed steps) run the compiled layer regions where the runner is
told to, and give the uncompiled steps' logits and KV. Traced with a backend that generates no code (fast on the
CPU); inductor's kernels run on the GPU (tests/engine/test_overlap.py)."""

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.model.compiled_layers import compile_layers
from pdserve.model.config import ModelConfig
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.select import select_backends
from tests.counting_backend import CountingBackend
from tests.engine.scheduled_steps import PAGE_SIZE, request_of, run_step


def test_compiled_eager_steps_give_the_uncompiled_logits_and_kv(tiny_v3):
    cfg = ModelConfig.from_dir(tiny_v3)
    cpu = torch.device("cpu")
    model = init_random_weights(build_model(cfg, select_backends("torch", "torch", cpu), cpu, torch.float32), seed=2)
    model.init_rope(cpu)
    torch._dynamo.reset()
    counting = CountingBackend()
    runners = {compiled: ModelRunner(model, 64, PAGE_SIZE, cpu, torch.float32,
                                     compiled=compile_layers(model, counting), compile_eager_steps=compiled)
               for compiled in (False, True)}
    # One request list per runner: each runner advances its own copies.
    requests = {compiled: {"a": request_of("a", 40, 0, 1), "b": request_of("b", 25, 16, 2),
                           "c": request_of("c", 30, 32, 3)} for compiled in (False, True)}
    steps = [
        {"a": 40, "b": 12},  # prefill: a whole, b's first chunk (expanded attention)
        {"a": 1, "b": 13, "c": 9},  # a decodes beside b's last chunk and c's first (a mixed step)
        {"a": 1, "b": 1, "c": 21},  # c's last chunk over its cached 9 tokens beside two decodes
    ]
    graphs_seen = []
    for step in steps:
        logits, kv = {}, {}
        for compiled, runner in runners.items():
            logits[compiled] = run_step(runner, requests[compiled], step)
            kv[compiled] = runner.kv_cache.clone()
            graphs_seen.append(counting.graphs)
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv[True], kv[False], rtol=1e-5, atol=1e-5)
    # The uncompiled runner never called a compiled region; the compiled one did from its first step on.
    assert graphs_seen[0] == 0 and graphs_seen[1] > 0
    assert all(graphs_seen[i] == graphs_seen[i + 1] for i in range(1, len(graphs_seen) - 1, 2))
