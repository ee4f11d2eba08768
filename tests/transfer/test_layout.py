import gc
import os
import random

import pytest
import torch

from pdserve.ops.attention import new_kv_pool
from pdserve.transfer.layout import PoolLayout, check_page_ids, page_runs, run_descriptors


def _layout(num_pages: int, base_addr: int) -> PoolLayout:
    return PoolLayout(base_addr=base_addr, num_layers=4, num_pages=num_pages, page_bytes=96, device_id=0, mem_type="DRAM")


def _page_pairs_of(src: PoolLayout, dst: PoolLayout, local, remote) -> list[tuple[int, int]]:
    """Expand paired descriptor rows back into (src page address, dst page address) pairs."""
    pairs = []
    for (src_addr, src_len, _), (dst_addr, dst_len, _) in zip(local.tolist(), remote.tolist()):
        assert src_len == dst_len and src_len % src.page_bytes == 0
        pairs += [(src_addr + k * src.page_bytes, dst_addr + k * dst.page_bytes) for k in range(src_len // src.page_bytes)]
    return pairs


@pytest.mark.parametrize("seed", range(20))
def test_coalesced_descriptors_move_the_same_pages_as_one_descriptor_per_page_and_layer(seed):
    rng = random.Random(seed)
    src, dst = _layout(30, 1 << 20), _layout(50, 1 << 30)
    count = rng.randint(1, 25)
    src_ids = rng.sample(range(30), count)
    dst_ids = rng.sample(range(50), count)
    if seed % 2:  # mostly consecutive ids, as a request's pages usually are
        src_ids.sort()
        start = rng.randint(0, 50 - count)
        dst_ids = list(range(start, start + count))
    layers = range(rng.randint(0, 2), rng.randint(2, 4))
    runs = page_runs(src_ids, dst_ids)
    local = run_descriptors(src, runs, layers, "src")
    remote = run_descriptors(dst, runs, layers, "dst")

    naive = [(src.page_addr(l, s), dst.page_addr(l, d)) for l in layers for s, d in zip(src_ids, dst_ids)]
    assert sorted(_page_pairs_of(src, dst, local, remote)) == sorted(naive)
    assert len(local) == (len(runs) if len(layers) == src.num_layers else count)


def test_consecutive_pages_become_one_descriptor_for_every_layer():
    runs = page_runs([4, 5, 6, 7], [10, 11, 12, 13])
    descs = run_descriptors(_layout(30, 0), runs, range(4), "dst")
    assert len(runs) == 1 and descs[:, :2].tolist() == [[10 * 4 * 96, 4 * 4 * 96]]


def test_a_break_on_either_side_splits_a_run():
    assert len(page_runs([1, 2, 3], [5, 6, 8])) == 2
    assert len(page_runs([1, 3, 4], [5, 6, 7])) == 2


def test_mismatched_or_out_of_range_page_ids_are_rejected():
    with pytest.raises(ValueError, match="one dst page per src page"):
        page_runs([1, 2], [1])
    with pytest.raises(ValueError, match=r"\[0, 30\)"):
        check_page_ids([3, 30], 30, "dst")


def test_layout_of_a_pool_tensor_gives_the_address_of_every_page():
    kv = new_kv_pool(3, 7, 4, 8, torch.bfloat16, torch.device("cpu"))
    layout = PoolLayout.of_pool(kv)
    assert layout.page_bytes == 4 * 8 * 2 and layout.mem_type == "DRAM"
    assert all(layout.page_addr(layer, page) == kv[layer, page].data_ptr() for layer in range(3) for page in range(7))
    with pytest.raises(ValueError, match="page-major"):  # layer-major: a run of pages would be a range per layer
        PoolLayout.of_pool(torch.zeros(3, 7, 4, 8))


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_pool_is_zeros_taken_from_the_kernel_as_touched():
    """A CPU rank's 1 GiB pool is zeros without being written at start (and so not resident), and the pool tensor
    alone keeps its memory."""
    before = resident_bytes()
    kv = new_kv_pool(8, 2**30 // (8 * 64 * 576 * 2), 64, 576, torch.bfloat16, torch.device("cpu"))[2:5, 10:]
    assert resident_bytes() - before < 64 * 2**20
    gc.collect()
    assert not kv[:, :3].any() and not kv[:, -3:].any()
    kv[1, 7] = 1.5
    assert kv[1, 7].eq(1.5).all() and kv.sum().item() == 1.5 * 64 * 576


@pytest.mark.parametrize("layers", [range(4), range(1, 3)])
def test_no_pages_make_no_descriptors(layers):
    assert run_descriptors(_layout(30, 0), [], layers, "src").shape == (0, 3)
