"""Lockstep stepping for the ranks of one expert-parallel instance: every rank runs the same number of forwards.

Each step the ranks all-reduce "I have work"; if any has, all step, the idle ones over an empty batch, so each MoE
exchange finds all its peers. One small collective per step buys the guarantee without a central scheduler.
"""

import torch
import torch.distributed as dist


class Lockstep:
    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group
        self.device = device  # gloo reduces CPU tensors, NCCL device tensors

    def any_rank_busy(self, busy: bool) -> bool:
        """Call on every rank alike; when True, every rank runs `engine.step(force_forward=True)` once."""
        flag = torch.tensor([int(busy)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
