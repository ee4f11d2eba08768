"""The expanded attention form (per-head keys and values from the latents) against the absorbed one it replaces
for prefill steps, on the torch reference in float32, and the per-step choice between them."""

import json
from pathlib import Path

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import uses_expanded_attention
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.attention import AttentionBatch
from pdserve.ops.select import select_backends
from tests.ops.test_attention_flashinfer import make_step


V2_LITE_CONFIG = Path(__file__).resolve().parents[2] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"


def _step(cfg: ModelConfig, query_lens, cached_lens, page_size=4, seed=0):
    """A layer-0 step over a random latent cache: inputs, cache, batch."""
    _, kv_cache, batch = make_step(query_lens, cached_lens, page_size, "cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(kv_cache.shape[0], page_size, cfg.kv_dim, generator=gen)
    x = torch.randn(sum(query_lens), cfg.hidden_size, generator=gen)
    positions = torch.tensor([p for q, n in zip(query_lens, batch.kv_lens) for p in range(n - q, n)])
    return x, positions, kv_cache, batch


def test_expanded_attention_equals_absorbed_with_and_without_cached_prefixes(tiny_v2):
    cfg = ModelConfig.from_dir(tiny_v2)
    backends = select_backends("torch", "torch", torch.device("cpu"), torch.float32)
    model = init_random_weights(build_model(cfg, backends, torch.device("cpu"), torch.float32), seed=3)
    layer = model.model.layers[0]
    for query_lens, cached_lens in (([5, 9], [0, 0]), ([5, 1, 12], [7, 30, 3])):
        x, positions, kv_cache, batch = _step(cfg, query_lens, cached_lens)
        rotations = model.rope.rotations(positions)
        absorbed_cache, expanded_cache = kv_cache.clone(), kv_cache.clone()
        with torch.inference_mode():
            absorbed = layer(x, rotations, model.rope, absorbed_cache, batch, backends, expanded=False)
            expanded = layer(x, rotations, model.rope, expanded_cache, batch, backends, expanded=True)
        assert torch.equal(absorbed_cache, expanded_cache), "both forms write the same latents to the same slots"
        assert not torch.equal(kv_cache, expanded_cache)
        torch.testing.assert_close(expanded, absorbed, rtol=1e-5, atol=1e-5)


def _batch(query_lens, kv_lens) -> AttentionBatch:
    return AttentionBatch(query_lens=query_lens, kv_lens=kv_lens, page_table=torch.zeros(len(kv_lens), 1),
                          slot_mapping=torch.zeros(sum(query_lens)), page_size=64)


def test_prefill_steps_expand_and_decode_steps_stay_absorbed():
    v2_lite = ModelConfig.from_dict(json.loads(V2_LITE_CONFIG.read_text()))
    assert uses_expanded_attention(v2_lite, _batch([4096], [4096]))  # a fresh prompt
    assert uses_expanded_attention(v2_lite, _batch([2048, 1], [16384, 300]))  # a long chunk (and a decode) over a prefix
    assert not uses_expanded_attention(v2_lite, _batch([1] * 64, [4096] * 64))  # decode
    assert not uses_expanded_attention(v2_lite, _batch([8], [4096]))  # a short chunk over a long prefix
    assert not uses_expanded_attention(v2_lite, _batch([], []))  # an idle expert-parallel rank
