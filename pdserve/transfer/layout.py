"""Where a KV page pool lives in memory, and the NIXL descriptors that cover a set of its pages.

A pool is one tensor stored page-major, [num_pages, num_layers, page_size, kv_dim], and handed around as its
layer-first view kv[num_layers, num_pages, ...] (pdserve.ops.attention.new_kv_pool). A page's rows of every layer
are one byte range of `page_stride` bytes, and a run of consecutive pages is one range: a request's whole KV moves
with a descriptor per run of pages, where layer-major it took one per run and layer (NIXL's post call costs ~10 us a
descriptor).
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
        """kv: the layer-first view [num_layers, num_pages, page_size, kv_dim] of a page-major pool."""
        if kv.dim() != 4 or not kv.transpose(0, 1).is_contiguous():
            raise ValueError(
                f"kv pool must be the [num_layers, num_pages, page_size, kv_dim] view of a page-major tensor, "
                f"got shape {tuple(kv.shape)} strides {kv.stride()}"
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
    def page_stride(self) -> int:
        """Bytes from one page to the next: the page's rows of every layer."""
        return self.num_layers * self.page_bytes

    def page_addr(self, layer: int, page: int) -> int:
        return self.base_addr + page * self.page_stride + layer * self.page_bytes


@dataclass(frozen=True, slots=True)
class PageRun:
    """`num_pages` pages that are consecutive on both sides: one descriptor moves them all (every layer)."""

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
    """Nx3 (address, length, device id) rows: one per run when `layers` is every layer; else one per page (the
    page's rows of those layers, one range; the next page's are a page stride further).

    Built for the source and the destination pool separately, in the same order, so row i of one side pairs with
    row i of the other."""
    starts = np.array([r.src_start if side == "src" else r.dst_start for r in runs], dtype=np.uint64)
    counts = np.array([r.num_pages for r in runs], dtype=np.uint64)
    stride = np.uint64(layout.page_stride)
    if len(layers) == layout.num_layers:
        addrs, lengths = np.uint64(layout.base_addr) + starts * stride, counts * stride
    else:  # each page on its own: the pages of a run are not adjacent in these layers
        pages = np.concatenate([np.empty(0, np.uint64),
                                *(np.arange(s, s + n, dtype=np.uint64) for s, n in zip(starts, counts))])
        addrs = np.uint64(layout.base_addr) + pages * stride + np.uint64(layers.start * layout.page_bytes)
        lengths = np.full(len(pages), len(layers) * layout.page_bytes, dtype=np.uint64)
    descs = np.empty((len(addrs), 3), dtype=np.uint64)
    descs[:, 0] = addrs
    descs[:, 1] = lengths
    descs[:, 2] = layout.device_id
    return descs
