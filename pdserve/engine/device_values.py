"""Host values onto the device without waiting for it: a blocking host-to-device copy waits for every kernel queued
before it, which would stall a host running a step ahead of the device (overlapped scheduling, engine.py). The source
is staged at once, so it may be dropped as soon as this returns."""

import torch


def on_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
