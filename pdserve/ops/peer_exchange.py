"""Equal-split all-to-alls between the GPUs of one host as direct writes into each other's memory (NVLink).

Every rank allocates one buffer in torch's symmetric memory, which maps each rank's buffer into every other rank's
address space. An all-to-all then is: one kernel that writes each peer's share into that peer's buffer, at this
rank's slot (pdserve/ops/peer_writes_triton.py); then a barrier kernel (a signal to and a wait on every peer, on the
device), after which every share sent to this rank has landed. Nothing waits on the host, so a CUDA graph holds it,
as it holds NCCL's all_to_all_single.
It moves the same bytes as NCCL's equal-split all_to_all_single with less around them: no proxy, no chunking into
NCCL's own buffers, and one barrier for several tensors (a dispatch's rows and their expert ids).

The buffer has regions, one per exchange that can be in flight at the same time (the expert-parallel layer's
dispatch and combine): a peer may write its combine while this rank still reads the dispatch it received. A region
is rewritten only after the barrier of the other, which every rank reaches after it has read the region, so two
regions suffice (docs/expert_parallel.md).
"""

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

ALIGN_BYTES = 256  # each tensor's place in a region: aligned for wide copies, a whole number of elements


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor.stride(0) * tensor.element_size()


def region_bytes_for(rows: int, row_bytes: Sequence[int]) -> int:
    """A region's size for exchanges of up to `rows` rows of tensors of these row sizes, a spare row each."""
    return sum(_aligned((rows + 1) * nbytes) for nbytes in row_bytes)


class PeerExchange:
    """Equal-split all-to-alls over `group` (None: the default group) by writes into peer memory; `region_bytes`:
    the most bytes each region receives in one exchange (what all_to_all returns, spare rows included). Making one is
    a collective (the ranks exchange their buffers' handles)."""

    def __init__(self, group: dist.ProcessGroup | None, region_bytes: Sequence[int], device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symmetric_memory

        group = group or dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._region_starts = [0]
        for nbytes in region_bytes:
            self._region_starts.append(self._region_starts[-1] + _aligned(nbytes))
        # Torch's rendezvous refuses ranks on the same device index, and under Ray each rank sees its one GPU as index
        # 0; that the ranks are on distinct GPUs is the caller's to check (ExpertParallelMoE compares their UUIDs).
        # (The same setting turns off NVLink multicast, which this exchange does not use and the GPU hosts forbid.)
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        self._buffer = symmetric_memory.empty(self._region_starts[-1], dtype=torch.uint8, device=device)
        self._handle = symmetric_memory.rendezvous(self._buffer, group)
        # every rank's buffer as mapped here, by rank: where the write kernel stores each peer's share
        self._peer_bases = torch.tensor(
            [self._handle.get_buffer(peer, (self._region_starts[-1],), torch.uint8, 0).data_ptr()
             for peer in range(self.world_size)], dtype=torch.int64, device=device)

    def fits(self, region: int, tensors: Sequence[torch.Tensor], spare_rows: int = 0) -> bool:
        return self._bytes_needed(tensors, spare_rows) <= self._region_starts[region + 1] - self._region_starts[region]

    def all_to_all(self, region: int, tensors: Sequence[torch.Tensor], spare_rows: int = 0) -> list[torch.Tensor]:
        """For each tensor ([R x C rows, ...], contiguous), rows [p C, p C + C) go to rank p, and the result holds
        what came, by sender (what all_to_all_single with equal splits returns), as a view of this rank's buffer,
        valid until `region`'s next exchange. The last tensor's result has `spare_rows` more rows, unset. One barrier
        for all of them."""
        if not self.fits(region, tensors, spare_rows):
            raise ValueError(f"{self._bytes_needed(tensors, spare_rows)} bytes do not fit region {region} "
                             f"({self._region_starts[region + 1] - self._region_starts[region]} bytes)")
        from pdserve.ops.peer_writes_triton import write_shares  # triton: on CUDA hosts only

        offset = self._region_starts[region]
        received, offsets = [], []
        for index, tensor in enumerate(tensors):
            if tensor.shape[0] % self.world_size:
                raise ValueError(f"{tensor.shape[0]} rows do not split evenly over {self.world_size} ranks")
            rows = tensor.shape[0] + (spare_rows if index == len(tensors) - 1 else 0)
            mine = self._buffer[offset:offset + rows * _row_bytes(tensor)].view(tensor.dtype)
            received.append(mine.view(rows, *tensor.shape[1:]))
            offsets.append(offset)
            offset += _aligned(rows * _row_bytes(tensor))
        for first in range(0, len(tensors), 2):  # the kernel writes two tensors at a time
            write_shares(self._peer_bases, self.rank, list(tensors[first:first + 2]), offsets[first:first + 2])
        self._handle.barrier(channel=0)
        return received

    def _bytes_needed(self, tensors: Sequence[torch.Tensor], spare_rows: int) -> int:
        return sum(_aligned((t.shape[0] + (spare_rows if i == len(tensors) - 1 else 0)) * _row_bytes(t))
                   for i, t in enumerate(tensors))
