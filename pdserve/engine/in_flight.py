"""Overlapped steps (engine.py): a step's sampled tokens on their way to the host. Their ids stay on the device, where
the next step reads its input ids from them; a pinned host copy is readable once the step's CUDA event has fired. On
the CPU the host copy is the tensors themselves and nothing waits, but the bookkeeping is the same."""

from dataclasses import dataclass, field

import torch

from pdserve.engine.device_values import on_device
from pdserve.engine.request import Request
from pdserve.engine.sampler import DeviceSample, SampleResult


@dataclass(frozen=True)
class CarriedTokens:
    """Input ids a step takes from the previous step's sampled tokens on the device: ids[positions[i]] is
    source[rows[i]]."""

    source: torch.Tensor  # [rows of the previous step] int64
    positions: list[int]  # in the step's flat input ids
    rows: list[int]

    def write_into(self, input_ids: torch.Tensor) -> None:
        input_ids[on_device(self.positions, input_ids.device)] = self.source[on_device(self.rows, input_ids.device)]


@dataclass
class InFlightStep:
    """What one overlapped step sampled, row by row, until the host reads it."""

    requests: list[Request]  # one per sampled row, in order
    token_ids: torch.Tensor  # [rows] int64 on the device: the next step's input ids
    host: DeviceSample  # the sample's host copy; readable once `ready` has fired
    ready: torch.cuda.Event | None  # None on the CPU
    rows: dict[str, int] = field(default_factory=dict)  # request id -> row

    @classmethod
    def launch(cls, requests: list[Request], sample: DeviceSample) -> "InFlightStep":
        """Starts the copy to the host behind the step's queued work; returns at once."""
        on_gpu = sample.token_ids.device.type == "cuda"
        host = sample.to_host(non_blocking=on_gpu)
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        rows = {request.request_id: row for row, request in enumerate(requests)}
        return cls(requests, sample.token_ids, host, ready, rows)

    def carried(self, positions: list[int], requests: list[Request]) -> CarriedTokens:
        """The input ids at `positions` are the tokens this step sampled for `requests` (one each)."""
        return CarriedTokens(self.token_ids, positions, [self.rows[r.request_id] for r in requests])

    def result(self) -> SampleResult:
        """Waits for the step (if it still runs) and reads its sample."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.result([request.sampling for request in self.requests])
