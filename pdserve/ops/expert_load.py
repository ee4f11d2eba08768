"""How many (token, expert) pairs each routed expert has received, per MoE layer, counted on the device: what
expert-load balancing needs to know (under expert parallelism the rank holding the hottest experts sets every
rank's step time). One index_add per MoE layer and step; the host reads the counts without waiting for the device."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLoad:
    counts: torch.Tensor  # [num layers, num routed experts] int64, cumulative since start; dense layers stay 0
    # [rows x top-k] 1 for a real row's pairs, 0 for padding (a CUDA graph's batch padded up); None: every row counts
    pair_weights: torch.Tensor | None = None

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, device: torch.device) -> "ExpertLoad":
        return cls(torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device))

    def masked(self, pair_weights: torch.Tensor) -> "ExpertLoad":
        """The same counts, with padding rows' pairs weighted 0 (a buffer the caller fills before each replay)."""
        return ExpertLoad(self.counts, pair_weights)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """topk_ids [rows, k]: global expert ids of each row's routed experts."""
        flat = topk_ids.reshape(-1)
        weights = torch.ones_like(flat) if self.pair_weights is None else self.pair_weights[: flat.numel()]
        self.counts[layer].index_add_(0, flat, weights)


def mark_real_rows(pair_weights: torch.Tensor, real_rows: int, rows: int, top_k: int) -> None:
    """Fill a masked ExpertLoad's `pair_weights` for a step of `rows` rows of which the first `real_rows` are real:
    two fills on the device, nothing built on the host."""
    pair_weights[: real_rows * top_k].fill_(1)
    pair_weights[real_rows * top_k: rows * top_k].fill_(0)


class ExpertCountsReader:
    """Reads the device counts into host memory behind the queued work (pinned memory and an event on CUDA), so that
    the step loop never waits for the GPU to report them: each read returns the last copy that has completed."""

    def __init__(self, load: ExpertLoad):
        self._load = load
        cuda = load.counts.device.type == "cuda"
        self._host = torch.zeros(load.counts.shape, dtype=torch.int64, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self._latest: list[int] = [0] * load.counts.shape[1]

    def per_expert(self) -> list[int]:
        """Pairs per expert, summed over layers, as of the last completed copy; starts the next copy."""
        if self._copied is None:
            self._host.copy_(self._load.counts)
        elif not self._copied.query():
            return self._latest
        self._latest = self._host.sum(dim=0).tolist()
        if self._copied is not None:
            self._host.copy_(self._load.counts, non_blocking=True)
            self._copied.record()
        return self._latest
