"""Routed-pair counts: each (row, expert) pair counts once in its layer's row, padding rows not at all, and the reader
sums layers; in an engine they equal what the routers chose, step by step."""

import torch

from pdserve import LLM, SamplingParams
from pdserve.ops.expert_load import ExpertCountsReader, ExpertLoad


def test_pairs_count_per_layer_and_padding_rows_do_not():
    load = ExpertLoad.zeros(num_layers=3, num_experts=6, device=torch.device("cpu"))
    topk_ids = torch.tensor([[0, 5], [5, 2], [1, 0]])
    load.record(1, topk_ids)
    assert load.counts[1].tolist() == [2, 1, 1, 0, 0, 2]
    assert load.counts[0].sum() == load.counts[2].sum() == 0
    pair_valid = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])  # two real rows of k=2, the rest padding (buffer is longer)
    load.masked(pair_valid).record(2, topk_ids)
    assert load.counts[2].tolist() == [1, 0, 1, 0, 0, 2]
    assert ExpertCountsReader(load).per_expert() == [3, 1, 2, 0, 0, 4]


def test_an_engine_counts_what_its_routers_chose(tiny_v2):
    llm = LLM(tiny_v2, dtype="float32", progress=False, enable_prefix_cache=False, max_num_batched_tokens=16)
    model = llm.engine.runner.model
    chosen = torch.zeros(model.cfg.n_routed_experts, dtype=torch.int64)

    def count(_module, _inputs, output) -> None:
        topk_ids, _ = output
        chosen.add_(torch.bincount(topk_ids.reshape(-1), minlength=chosen.numel()))

    hooks = [layer.mlp.gate.register_forward_hook(count) for layer in model.model.layers if layer.is_moe]
    prompts = [list(range(3, 40)), list(range(50, 61))]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompt_token_ids=prompts, sampling=sampling)
    finally:
        for hook in hooks:
            hook.remove()
    counted = llm.engine.stats().expert_tokens
    rows = sum(len(p) + sampling.max_tokens - 1 for p in prompts)  # the last token is sampled, never fed back
    assert counted == chosen.tolist()
    assert sum(counted) == rows * model.cfg.num_experts_per_tok * len(hooks) > 0
