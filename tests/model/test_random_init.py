import torch

from pdserve.model.config import ModelConfig
from pdserve.model.loader import build_model
from pdserve.model.random_init import init_random_weights
from pdserve.ops.select import select_backends


def test_random_weights_are_seeded_and_finite(tiny_v2):
    cfg = ModelConfig.from_dir(tiny_v2)
    backends = select_backends("torch", "torch", torch.device("cpu"), torch.float32)

    def make(seed):
        return init_random_weights(build_model(cfg, backends, torch.device("cpu"), torch.float32), seed)

    a, b, c = make(1), make(1), make(2)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["lm_head.weight"], pc["lm_head.weight"])
    assert all(torch.isfinite(p).all() for p in pa.values())
    assert torch.all(pa["model.norm.weight"] == 1)
