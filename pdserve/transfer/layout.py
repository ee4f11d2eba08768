"""Where a KV page pool lives in memory, and the NIXL descriptors that cover a set of its pages.

A pool is one contiguous tensor kv[num_layers, num_pages, page_size, kv_dim]; a page of a request is the slice
kv[l, p] of every layer l, so one page is `num_layers` separate byte ranges, `layer_bytes` apart.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

MemType = Literal["DRAM", "VRAM"]


@dataclass(frozen=True, slots=True)
class PoolLayout:
    base_addr: int
    num_layers: int
    num_pages: int
    page_bytes: int  # one page of one layer: page_size * kv_dim * element size
    device_id: int  # GPU ordinal for VRAM; 0 for DRAM (what NIXL expects)
    mem_type: MemType

    @classmethod
    def of_pool(cls, kv: torch.Tensor) -> "PoolLayout":
        if kv.dim() != 4 or not kv.is_contiguous():
            raise ValueError(
                f"kv pool must be a contiguous [num_layers, num_pages, page_size, kv_dim] tensor, "
                f"got shape {tuple(kv.shape)} contiguous={kv.is_contiguous()}"
            )
        num_layers, num_pages = kv.shape[0], kv.shape[1]
        on_cpu = kv.device.type == "cpu"
        return cls(
            base_addr=kv.data_ptr(),
            num_layers=num_layers,
            num_pages=num_pages,
            page_bytes=kv[0, 0].numel() * kv.element_size(),
            device_id=0 if on_cpu else (kv.device.index or 0),
            mem_type="DRAM" if on_cpu else "VRAM",
        )

    @property
    def layer_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def page_addr(self, layer: int, page: int) -> int:
        return self.base_addr + layer * self.layer_bytes + page * self.page_bytes


@dataclass(frozen=True, slots=True)
class PageRun:
    """`num_pages` pages that are consecutive on both sides: one descriptor per layer moves them all."""

    src_start: int
    dst_start: int
    num_pages: int


def check_page_ids(page_ids: Sequence[int], num_pages: int, side: str) -> None:
    bad = [p for p in page_ids if not 0 <= p < num_pages]
    if bad:
        raise ValueError(f"{side} page ids must be in [0, {num_pages}), got {bad[:8]}")


def page_runs(src_page_ids: Sequence[int], dst_page_ids: Sequence[int]) -> list[PageRun]:
    """Split the (src, dst) page pairs, in the given order, into maximal runs consecutive on both sides."""
    if len(src_page_ids) != len(dst_page_ids):
        raise ValueError(f"need one dst page per src page, got {len(src_page_ids)} src and {len(dst_page_ids)} dst")
    runs: list[PageRun] = []
    for src, dst in zip(src_page_ids, dst_page_ids):
        last = runs[-1] if runs else None
        if last and src == last.src_start + last.num_pages and dst == last.dst_start + last.num_pages:
            runs[-1] = PageRun(last.src_start, last.dst_start, last.num_pages + 1)
        else:
            runs.append(PageRun(src, dst, 1))
    return runs


def run_descriptors(layout: PoolLayout, runs: Sequence[PageRun], layers: range, side: Literal["src", "dst"]) -> np.ndarray:
    """Nx3 (address, length, device id) rows: layer-major, one row per (layer, run).

    Built for the source and the destination pool separately, in the same order, so row i of one side
    pairs with row i of the other even though the two pools differ in num_pages (hence layer stride)."""
    starts = np.array([r.src_start if side == "src" else r.dst_start for r in runs], dtype=np.uint64)
    lengths = np.array([r.num_pages for r in runs], dtype=np.uint64) * np.uint64(layout.page_bytes)
    layer_offsets = np.array(layers, dtype=np.uint64) * np.uint64(layout.layer_bytes)
    addrs = np.uint64(layout.base_addr) + layer_offsets[:, None] + starts[None, :] * np.uint64(layout.page_bytes)
    descs = np.empty((len(layers) * len(runs), 3), dtype=np.uint64)
    descs[:, 0] = addrs.reshape(-1)
    descs[:, 1] = np.tile(lengths, len(layers))
    descs[:, 2] = layout.device_id
    return descs
