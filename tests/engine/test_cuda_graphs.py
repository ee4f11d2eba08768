"""Decode under CUDA graphs gives the eager tokens; the GPU float32 path gives the CPU tokens; CPU never captures."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.cuda_graphs import capture_sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# flashinfer's kernels take the real latent widths (512 + 64), 16 heads and the expanded prefill's 192/128 heads;
# the rest stays tiny.
FLASHINFER_SHAPE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "qk_nope_head_dim": 128, "v_head_dim": 128}


def prompts_of(lengths, vocab=500, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_capture_sizes_stop_at_max_num_seqs_and_include_it():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert capture_sizes(1000) == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_cpu_engine_captures_nothing_and_keeps_its_page_count(tiny_v2):
    engine = LLM(tiny_v2, progress=False, device="cpu", num_pages=32).engine
    assert engine.runner.decode_graphs is None
    assert engine.runner.kv_cache.shape[1] == 32


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compile_layers", ["off", "on"])
def test_graph_decode_gives_the_eager_tokens(tiny_model_factory, compile_layers):
    """Captured as they are, and with the layers' regions compiled into fused kernels by inductor, against eager
    steps of the same layers (compiled ones run the compiled regions eagerly: inductor's bf16 kernels round
    differently from eager torch's, so only the same regions promise the same greedy tokens)."""
    model = tiny_model_factory("v2", **FLASHINFER_SHAPE)
    prompts = prompts_of((3, 40, 77, 150, 201))
    # Different lengths: the batch shrinks 5 -> 1 and runs padded (5 -> 8, 3 -> 4) along the way.
    sampling = [greedy(n) for n in (6, 9, 12, 15, 18)]
    options = dict(progress=False, dtype="bfloat16", max_num_seqs=8, page_size=16, num_pages=128)
    graphed = LLM(model, cuda_graphs=True, compile_layers=compile_layers, **options)
    assert graphed.engine.runner.decode_graphs is not None
    assert (graphed.engine.runner.compiled is not None) == (compile_layers == "on")
    assert graphed.engine.runner.decode_graphs.sizes == (1, 2, 4, 8)
    eager = LLM(model, cuda_graphs=False, compile_layers=compile_layers, **options)
    assert eager.engine.runner.decode_graphs is None
    graph_tokens = [r.token_ids for r in graphed.generate(prompt_token_ids=prompts, sampling=sampling)]
    eager_tokens = [r.token_ids for r in eager.generate(prompt_token_ids=prompts, sampling=sampling)]
    assert graph_tokens == eager_tokens
    assert [len(t) for t in graph_tokens] == [6, 9, 12, 15, 18]
    # Routed pairs: padding rows of a graph's batch are not counted, so both count every fed token's pairs once.
    cfg = graphed.engine.model_config
    pairs = sum(len(p) + s.max_tokens - 1 for p, s in zip(prompts, sampling)) * cfg.num_experts_per_tok * sum(
        cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    for llm in (graphed, eager):
        llm.engine.stats()  # starts the copy the next read returns
        torch.cuda.synchronize()
        assert sum(llm.engine.stats().expert_tokens) == pairs


@pytest.mark.gpu
@needs_cuda
def test_fp8_graph_decode_gives_the_eager_tokens(tiny_model_factory):
    """FP8 weights kept (auto on CUDA): the Triton and cuBLAS FP8 GEMMs inside captured graphs."""
    pytest.importorskip("flashinfer", reason="decode graphs run on the flashinfer attention backend")
    model = tiny_model_factory("v3", fp8=True, **FLASHINFER_SHAPE, hidden_size=512, moe_intermediate_size=128)
    prompts = prompts_of((3, 40, 150))
    sampling = [greedy(n) for n in (6, 9, 12)]
    options = dict(progress=False, dtype="bfloat16", max_num_seqs=4, page_size=16, num_pages=64)
    graphed = LLM(model, cuda_graphs=True, **options)
    assert graphed.engine.runner.decode_graphs is not None
    assert any(p.dtype == torch.float8_e4m3fn for p in graphed.engine.runner.model.parameters())
    eager = LLM(model, cuda_graphs=False, **options)
    graph_tokens = [r.token_ids for r in graphed.generate(prompt_token_ids=prompts, sampling=sampling)]
    eager_tokens = [r.token_ids for r in eager.generate(prompt_token_ids=prompts, sampling=sampling)]
    assert graph_tokens == eager_tokens


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_gpu_float32_greedy_gives_the_cpu_tokens(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    prompts = prompts_of((1, 16, 33, 120))
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model, progress=False, device=device, dtype="float32", num_pages=128)
        tokens[device] = [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling=greedy(24))]
    assert tokens["cuda"] == tokens["cpu"]
