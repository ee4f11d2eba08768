"""A simulated model runner: the engine keeps its real scheduler, page pool, radix cache and KV events, but a step
computes nothing. It sleeps the time a measured step profile (step_profile.py) predicts for what was scheduled, and
its logits are random (tokens are drawn from the model's vocabulary). Many simulated ranks fit in one process, which
is how routing and pool sizing are studied at cluster scale on a CPU (docs/simulation.md).

Use it with a small model directory (the tiny model: its vocabulary and tokenizer) and a profile of the model whose
timing is simulated; the profile also sizes the KV pool as that model's GPU pool would be."""

import time

import torch

from pdserve.engine.in_flight import InFlightStep
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.step_profile import StepProfile
from pdserve.engine.step_shape import step_shape


class SimulatedRunner:
    """The ModelRunner's part the engine uses: a KV tensor (one byte per token: pages move between pools as real
    bytes, and pdserve/transfer/simulated_link.py makes a write take the simulated model's time) and `execute`."""

    def __init__(self, profile: StepProfile, vocab_size: int, num_pages: int, page_size: int, time_scale: float,
                 seed: int):
        self.profile = profile
        self.vocab_size = vocab_size
        self.page_size = page_size
        self.time_scale = time_scale
        self.kv_cache = torch.zeros(1, num_pages, page_size, 1, dtype=torch.uint8)
        # What one page of the simulated model's KV is, and takes to write to a decode pool (scaled).
        self.bytes_per_page = profile.kv_bytes_per_token * page_size
        self.seconds_per_page_written = self.bytes_per_page / (profile.kv_write_gb_per_s * 1e9) * time_scale
        self.simulated_s = 0.0  # step time slept so far, before scaling
        self._slept_s = 0.0  # since take_device_wait_s last asked: the simulated device's time, which the host waits
        self._generator = torch.Generator().manual_seed(seed)

    def execute(self, scheduled: list[ScheduledSeq], previous: InFlightStep | None = None) -> torch.Tensor:
        """`previous` (an overlapped step in flight) is ignored: nothing here reads input ids."""
        seconds = self.profile.step_ms(step_shape(scheduled)) / 1000
        self.simulated_s += seconds
        time.sleep(seconds * self.time_scale)
        self._slept_s += seconds * self.time_scale
        rows = sum(1 for seq in scheduled if seq.samples)
        return torch.randn(rows, self.vocab_size, generator=self._generator)

    def take_device_wait_s(self) -> float:
        """The sleep since the last call: here the host waits out every step the simulated device computes."""
        slept_s, self._slept_s = self._slept_s, 0.0
        return slept_s
