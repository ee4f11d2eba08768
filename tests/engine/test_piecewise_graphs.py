"""Steps run as pieces between their attention calls, with the tokens padded to a captured size, give the model's own
forward: logits, KV and the experts' load counts (padding rows count no load). On the CPU the pieces run directly;
on CUDA the same pieces are replayed captures (tests/engine/test_cuda_graphs.py)."""

from dataclasses import replace

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.piecewise_graphs import PiecewiseGraphConfig, token_sizes
from pdserve.model.compiled_layers import compile_layers
from pdserve.model.config import ModelConfig
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.expert_load import ExpertLoad
from pdserve.ops.select import select_backends
from tests.engine.scheduled_steps import PAGE_SIZE, request_of, run_step
from tests.engine.test_cuda_graphs import FLASHINFER_SHAPE, needs_cuda, prompts_of
from tests.engine.test_overlap import GREEDY, Arrival, assert_divergences_are_near_ties, drive

SIZES = (8, 16, 32, 56)
STEPS = [
    {"a": 40, "b": 12},  # prefill: a whole, b's first chunk (expanded attention), padded 52 -> 56
    {"a": 1, "b": 13, "c": 9},  # a decodes beside b's last chunk and c's first: a mixed step, 23 -> 32
    {"a": 1, "b": 1, "c": 21},  # c's last chunk over its cached 9 tokens beside two decodes, 23 -> 32
    {"a": 1, "b": 1, "c": 1},  # a decode batch, padded 3 -> 8
    {"d": 60},  # more tokens than the largest size: the model's own forward
]


def runner_of(model_dir: str, sizes: tuple[int, ...] | None, compiled: bool) -> ModelRunner:
    cfg = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    backends = replace(select_backends("torch", "torch", cpu),
                       expert_load=ExpertLoad.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, cpu))
    model = init_random_weights(build_model(cfg, backends, cpu, torch.float32), seed=2)
    model.init_rope(cpu)
    layers = compile_layers(model, "eager") if compiled else None
    return ModelRunner(model, 64, PAGE_SIZE, cpu, torch.float32, compiled=layers, compile_eager_steps=compiled,
                       piecewise=PiecewiseGraphConfig(sizes) if sizes else None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-regions", "compiled-regions"])
def test_pieces_padded_to_a_captured_size_give_the_forward_logits_kv_and_expert_load(tiny_v3, compiled):
    torch._dynamo.reset()
    runners = {pieces: runner_of(tiny_v3, SIZES if pieces else None, compiled) for pieces in (False, True)}
    assert runners[True].piecewise_graphs is not None
    requests = {pieces: {"a": request_of("a", 40, 0, 1), "b": request_of("b", 25, 16, 2),
                         "c": request_of("c", 30, 32, 3), "d": request_of("d", 60, 48, 4)} for pieces in runners}
    for step in STEPS:
        logits = {p: run_step(runner, requests[p], step) for p, runner in runners.items()}
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runners[True].kv_cache, runners[False].kv_cache, rtol=1e-5, atol=1e-5)
    counts = {p: runner.model.backends.expert_load.counts for p, runner in runners.items()}
    assert counts[False].sum() > 0
    assert torch.equal(counts[True], counts[False])


def test_token_sizes_end_at_the_step_budget_or_where_steps_stop_being_host_bound():
    assert token_sizes(100) == (64, 100)
    assert token_sizes(1000)[-2:] == (896, 1000)
    assert token_sizes(8192)[-1] == 2048  # larger steps run without graphs
    sizes = token_sizes(8192)
    assert list(sizes) == sorted(set(sizes)) and all(b / a <= 2 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compile_layers", ["off", "on"])
def test_captured_pieces_give_the_tokens_of_steps_without_them(tiny_model_factory, compile_layers):
    """On CUDA the pieces are replayed captures. Steps padded to a captured size run other GEMM shapes than the
    unpadded ones, and bf16 kernels may round a row differently by shape: tokens may differ where two candidates'
    logits nearly tie, and only there."""
    model = tiny_model_factory("v2", **FLASHINFER_SHAPE)
    prompts = prompts_of((3, 40, 77, 150, 201, 17))
    sampling = [replace(GREEDY, max_tokens=n, logprobs=True, top_logprobs=2) for n in (6, 9, 12, 15, 18, 21)]
    # A 96-token budget: the long prompts prefill in chunks beside decodes (mixed steps), several steps exceed none.
    options = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=96, page_size=16,
                   num_pages=128, cuda_graphs=True, progress=False, compile_layers=compile_layers)
    arrivals = [Arrival(f"r{i}", p, s, after=None if i < 4 else ("r0", 2 * i - 6))
                for i, (p, s) in enumerate(zip(prompts, sampling))]
    runs = {}
    for pieces in (False, True):
        engine = Engine(EngineConfig(model=model, piecewise_graphs=pieces, **options))
        assert (engine.runner.piecewise_graphs is not None) == pieces
        runs[pieces] = drive(engine, arrivals)
    assert [len(runs[True].tokens[f"r{i}"]) for i in range(6)] == [6, 9, 12, 15, 18, 21]
    print("divergences (request, position, margins):", assert_divergences_are_near_ties(runs[False], runs[True]))
