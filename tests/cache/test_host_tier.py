"""The prefix cache's host tier: evicted pages come back with their bytes, the events say what the rank holds in
either tier, and the bookkeeping survives random traffic. Real tensors on both sides (the engine's copier)."""

import random

import pytest
import torch

from pdserve.cache.host_tier import EvictedPage, HostTier
from pdserve.cache.page_allocator import PageAllocator
from pdserve.cache.radix_cache import RadixCache
from pdserve.engine.host_kv_pool import HostKVPool, available_host_bytes
from pdserve.ops.attention import new_kv_pool
from pdserve.wire.block_hash import prefix_page_hashes
from pdserve.wire.kv_events import KVEvent
from tests.cache.test_radix_cache import replay

PAGE_SIZE = 4
LAYERS, KV_DIM = 2, 3


class Rank:
    """A device pool, a host tier of `host_pages`, and a tree over them; each page's bytes say which prefix it holds."""

    def __init__(self, device_pages: int, host_pages: int):
        self.events: list[KVEvent] = []
        self.allocator = PageAllocator(device_pages)
        self.kv = new_kv_pool(LAYERS, device_pages, PAGE_SIZE, KV_DIM, torch.float32, torch.device("cpu"))
        page_bytes = LAYERS * PAGE_SIZE * KV_DIM * 4
        self.host_pool = HostKVPool(self.kv, host_pages * page_bytes / 2**30)
        assert self.host_pool.num_slots == host_pages
        self.tier = HostTier(host_pages, self.host_pool.to_host, self.host_pool.to_device)
        self.cache = RadixCache(self.allocator, PAGE_SIZE, self.events.extend, self.tier)

    def compute(self, token_ids: list[int]) -> None:
        """What a request does: take the cached prefix, write the rest's KV, hand the full pages to the tree."""
        match = self.cache.match_prefix(token_ids)
        self.check_bytes(token_ids, match.page_ids)
        more = self.cache.alloc_or_evict(len(token_ids) // PAGE_SIZE - len(match.page_ids))
        assert more is not None
        page_ids = match.page_ids + more
        for index, block_hash in enumerate(prefix_page_hashes(token_ids, PAGE_SIZE)):
            if index >= len(match.page_ids):
                self.kv[:, page_ids[index]] = float(block_hash % 1_000_003)
        self.cache.insert(token_ids, page_ids)
        self.allocator.decref(page_ids)

    def check_bytes(self, token_ids: list[int], page_ids: list[int]) -> None:
        for block_hash, page_id in zip(prefix_page_hashes(token_ids, PAGE_SIZE), page_ids):
            assert torch.all(self.kv[:, page_id] == float(block_hash % 1_000_003)), f"page {page_id} holds other KV"


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host_with_its_bytes():
    rank = Rank(device_pages=4, host_pages=8)
    first = list(range(16))  # 4 pages: the whole device pool
    rank.compute(first)
    rank.compute(list(range(100, 116)))  # evicts all of the first prompt's pages into the host tier
    assert rank.cache.num_cached_pages == 4 and rank.tier.num_pages == 4 and rank.tier.offloaded_pages == 4
    match = rank.cache.match_prefix(first + [7])
    assert match.num_tokens == 16 and rank.tier.loaded_pages == 4
    rank.check_bytes(first, match.page_ids)
    rank.allocator.decref(match.page_ids)
    rank.cache.check_integrity()


def test_events_count_a_page_as_held_while_either_tier_has_it():
    rank = Rank(device_pages=4, host_pages=4)
    prompts = [list(range(start, start + 8)) for start in (0, 100, 200, 300)]
    for prompt in prompts:
        rank.compute(prompt)
    # The device holds the last two prompts, the host the first two: nothing was removed yet.
    assert not [e for e in rank.events if e.kind == "removed"]
    assert replay(rank.events) == set(rank.cache.stored_blocks())
    assert len(rank.cache.stored_blocks()) == 8
    rank.compute(list(range(400, 408)))  # the host drops the least recent: the first prompt
    removed = [h for e in rank.events if e.kind == "removed" for h in e.block_hashes]
    assert sorted(removed) == sorted(prefix_page_hashes(prompts[0], PAGE_SIZE))
    assert replay(rank.events) == set(rank.cache.stored_blocks())


def test_a_page_loaded_back_is_not_copied_again_when_evicted_once_more():
    rank = Rank(device_pages=2, host_pages=4)
    rank.compute(list(range(8)))
    rank.compute(list(range(100, 108)))
    rank.compute(list(range(8)))  # loaded back; the second prompt goes to the host
    assert (rank.tier.loaded_pages, rank.tier.offloaded_pages) == (2, 4)
    rank.compute(list(range(100, 108)))
    assert (rank.tier.loaded_pages, rank.tier.offloaded_pages) == (4, 4)
    assert rank.tier.num_pages == 4
    rank.cache.check_integrity()


def test_pages_being_loaded_are_not_dropped_to_make_room_for_the_evictions_they_cause():
    rank = Rank(device_pages=2, host_pages=2)
    rank.compute(list(range(8)))
    rank.compute(list(range(100, 108)))  # host: the first prompt's 2 pages; device: the second's
    match = rank.cache.match_prefix(list(range(8)) + [1])
    # Loading needed both device pages: the second prompt's pages were evicted, and the full host tier could not
    # take them without dropping the pages being loaded, so they are gone (and said to be).
    assert match.num_tokens == 8
    rank.check_bytes(list(range(8)), match.page_ids)
    removed = [h for e in rank.events if e.kind == "removed" for h in e.block_hashes]
    assert sorted(removed) == sorted(prefix_page_hashes(list(range(100, 108)), PAGE_SIZE))
    rank.allocator.decref(match.page_ids)
    assert replay(rank.events) == set(rank.cache.stored_blocks())
    rank.cache.check_integrity()


def test_no_load_when_the_device_cannot_make_room():
    rank = Rank(device_pages=2, host_pages=4)
    rank.compute(list(range(8)))
    rank.compute(list(range(100, 108)))
    held = rank.cache.match_prefix(list(range(100, 108)) + [1])  # a running request locks both device pages
    assert rank.cache.match_prefix(list(range(8)) + [1]).num_tokens == 0
    assert rank.tier.loaded_pages == 0
    rank.allocator.decref(held.page_ids)


def test_a_tier_larger_than_the_memory_left_is_refused_before_it_is_allocated(tmp_path):
    kv = new_kv_pool(LAYERS, 4, PAGE_SIZE, KV_DIM, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"host KV tier of 1000000 GiB per rank is more than this process may still "
                                         r"take \([0-9.]+ GiB available\); lower --host-kv-cache-gib"):
        HostKVPool(kv, 1_000_000)
    # A pod's limit counts where it leaves less than the machine: 10 GiB, 9.5 of it used.
    (tmp_path / "memory.max").write_text(str(10 * 2**30))
    (tmp_path / "memory.current").write_text(str(19 * 2**29))
    (tmp_path / "meminfo").write_text("MemTotal: 99999999 kB\nMemAvailable:   33554432 kB\n")
    assert available_host_bytes(tmp_path / "meminfo", tmp_path) == 2**29
    (tmp_path / "memory.max").write_text("max\n")
    assert available_host_bytes(tmp_path / "meminfo", tmp_path) == 32 * 2**30
    assert available_host_bytes(tmp_path / "none", tmp_path / "none") is None


def test_a_hash_with_other_tokens_is_not_a_hit():
    copies: list[tuple[list[int], list[int]]] = []
    tier = HostTier(4, lambda src, dst: copies.append((src, dst)), lambda src, dst: copies.append((src, dst)))
    tokens = (1, 2, 3, 4)
    [block_hash] = prefix_page_hashes(list(tokens), PAGE_SIZE)
    tier.keep([EvictedPage(block_hash, 0, (9, 9, 9, 9), page_id=0)])  # as if another page had collided
    assert tier.find(0, list(tokens), 0, PAGE_SIZE) == []


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_bytes_events_and_bookkeeping_right(seed):
    """Prompts sharing system prompts through a small pool, some held a while by running requests."""
    rng = random.Random(seed)
    rank = Rank(device_pages=12, host_pages=10)
    system_prompts = [[rng.randrange(50) for _ in range(PAGE_SIZE * rng.randint(1, 3))] for _ in range(4)]
    held: list[list[int]] = []  # running requests' pages, locked in the tree meanwhile
    for _ in range(300):
        prompt = rng.choice(system_prompts) + [rng.randrange(50) for _ in range(PAGE_SIZE * rng.randint(0, 3))]
        if rng.random() < 0.3 and len(held) < 2:
            match = rank.cache.match_prefix(prompt)
            rank.check_bytes(prompt, match.page_ids)
            held.append(match.page_ids)
        elif held and rng.random() < 0.3:
            rank.allocator.decref(held.pop(0))
        else:
            rank.compute(prompt)
        rank.cache.check_integrity()
    assert rank.tier.loaded_pages > 0 and rank.tier.offloaded_pages > rank.tier.num_slots
    assert replay(rank.events) == set(rank.cache.stored_blocks())
