"""The router's top-k by counting ranks (the few-token path of compiled regions) picks what torch.topk picks, in
its order, ties to the lower id included; and a compiled router takes that path only for a few tokens."""

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import FUSED_ROUTING_MAX_TOKENS, TopkRouter, ranked_top_k
from pdserve.ops.token_dynamic import compile_token_dynamic


@pytest.mark.parametrize("rows, experts, k", [(1, 64, 6), (5, 64, 6), (16, 256, 8), (3, 8, 8)])
def test_ranked_top_k_picks_torch_topk_ids_in_its_order(rows, experts, k):
    scores = torch.rand(rows, experts, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(ranked_top_k(scores, k), torch.topk(scores, k).indices)


def test_ranked_top_k_breaks_ties_to_the_lower_id_and_never_picks_minus_infinity():
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.2, float("-inf"), 0.3]])
    assert ranked_top_k(scores, 4).tolist() == [[1, 2, 5, 3]]


def test_a_compiled_router_routes_a_few_tokens_and_many_as_the_eager_one(tiny_model_factory):
    cfg = ModelConfig.from_dir(tiny_model_factory("v2"))
    router = TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = compile_token_dynamic(router, backend)
    for tokens in (3, FUSED_ROUTING_MAX_TOKENS, 40, 2):
        x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
        with torch.inference_mode():
            eager_ids, eager_weights = router(x)
            ids, weights = compiled(x)
        order = eager_ids.argsort(dim=-1)  # torch.topk's order is unspecified (sorted=False), the ranked one's is not
        assert torch.equal(ids.sort(dim=-1).values, eager_ids.gather(1, order))
        torch.testing.assert_close(weights.gather(1, ids.argsort(dim=-1)), eager_weights.gather(1, order))
    # one graph for a few tokens (3, 16 and 2 share it), one for many; only the latter sorts
    sorts = [any(node.target is torch.topk for node in gm.graph.nodes) for gm in graphs]
    assert sorts == [False, True]
