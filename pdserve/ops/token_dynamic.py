"""torch.compile for code that runs at many batch sizes: only the token dimension is symbolic."""

from collections.abc import Callable

import torch
from torch import nn


RECOMPILE_LIMIT = 32


def compile_token_dynamic(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """`fn` compiled whole (no graph breaks), called with dimension 0 of every tensor argument marked dynamic, and
    only that one, so one graph serves every batch size (1 aside) while the other dimensions stay constants the
    kernels are specialised for. (`dynamic=True` would make every dimension a symbol, and sizes that happened to be
    equal on the first call would be assumed equal ever after.) Parameters passed in are weights: never marked.
    `backend`: torch.compile's; inductor generates fused kernels (tests trace with others, which is fast)."""
    options = {"compile_threads": 1} if backend == "inductor" else None  # no worker pool: see pdserve.ops.moe_grouped
    # A layer region keeps a graph per layer kind (dense, MoE), attention form and token-count class (1, a few for
    # the fused routing, many): more than dynamo's default limit of 8 for one function.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, options=options)

    def call(*args):
        for arg in args:
            if isinstance(arg, torch.Tensor) and not isinstance(arg, nn.Parameter):
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return call
