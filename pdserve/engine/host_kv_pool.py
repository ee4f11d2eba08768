"""Host memory for the prefix cache's second tier, and the copies of whole pages between it and the device KV pool.

Page-major like the device pool, so a run of consecutive pages on both sides is one copy. On CUDA it is pinned and
every copy is enqueued on the current (the step's) stream without waiting: ordered after the steps launched before it
and before those launched after, which is all the tier's bookkeeping relies on.
"""

import logging
import time
from pathlib import Path

import torch

from pdserve.ops.attention import new_kv_pool
from pdserve.transfer.layout import page_runs

log = logging.getLogger(__name__)


class HostKVPool:
    def __init__(self, device_kv: torch.Tensor, budget_gib: float):
        """`device_kv`: the rank's pool, the layer-first view [layers, pages, page_size, kv_dim] of page-major
        storage; `budget_gib`: host memory for this rank's tier."""
        self.device_pages = device_kv.transpose(0, 1)  # [pages, layers, page_size, kv_dim], each page one range
        num_layers, page_size, kv_dim = self.device_pages.shape[1:]
        page_bytes = self.device_pages[0].numel() * device_kv.element_size()
        self.num_slots = int(budget_gib * 2**30 // page_bytes)
        if self.num_slots < 1:
            raise ValueError(f"a host KV tier of {budget_gib} GiB holds no page of {page_bytes} bytes")
        available = available_host_bytes()
        if available is not None and self.num_slots * page_bytes > available:
            # Pinned, it would fail in the CUDA driver with an unclear error; mapped on the CPU, the kernel would kill
            # the worker once the tier filled, long after its start.
            raise ValueError(f"a host KV tier of {budget_gib} GiB per rank is more than this process may still take "
                             f"({available / 2**30:.1f} GiB available); lower --host-kv-cache-gib")
        started_s = time.perf_counter()
        if device_kv.device.type == "cuda":
            self.host_pages = torch.empty((self.num_slots, num_layers, page_size, kv_dim), dtype=device_kv.dtype,
                                          pin_memory=True)
        else:  # mapped and zero on first touch, as the CPU's device pool
            self.host_pages = new_kv_pool(num_layers, self.num_slots, page_size, kv_dim, device_kv.dtype,
                                          torch.device("cpu")).transpose(0, 1)
        log.info("host KV tier: %s pages (%.1f GiB) in %.1f s", self.num_slots, self.num_slots * page_bytes / 2**30,
                 time.perf_counter() - started_s)

    def to_host(self, page_ids: list[int], slots: list[int]) -> None:
        _copy_runs(self.device_pages, page_ids, self.host_pages, slots)

    def to_device(self, slots: list[int], page_ids: list[int]) -> None:
        _copy_runs(self.host_pages, slots, self.device_pages, page_ids)


def _copy_runs(source: torch.Tensor, source_ids: list[int], target: torch.Tensor, target_ids: list[int]) -> None:
    """target[target_ids[i]] = source[source_ids[i]] in order, one copy per run consecutive on both sides (the runs a
    KV transfer moves as one descriptor each)."""
    for run in page_runs(source_ids, target_ids):
        target[run.dst_start : run.dst_start + run.num_pages].copy_(
            source[run.src_start : run.src_start + run.num_pages], non_blocking=True)


def available_host_bytes(meminfo: Path = Path("/proc/meminfo"),
                         cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory this process may still take: the machine's MemAvailable, or its cgroup's (v2) room under its limit where
    that is smaller (a pod's limit); None where neither can be read."""
    found = []
    try:
        kib = next(line.split()[1] for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))
        found.append(int(kib) * 1024)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
