import random
from collections import Counter

import pytest

from pdserve.cache.page_allocator import PageAllocator
from pdserve.cache.radix_cache import RadixCache
from pdserve.wire.block_hash import ROOT_HASH, prefix_page_hashes
from pdserve.wire.kv_events import KVEvent

PAGE_SIZE = 4


def make_cache(num_pages: int = 32, page_size: int = PAGE_SIZE):
    events: list[KVEvent] = []
    allocator = PageAllocator(num_pages)
    cache = RadixCache(allocator, page_size, on_events=events.extend)
    return allocator, cache, events


def compute_and_insert(allocator: PageAllocator, cache: RadixCache, token_ids: list[int]) -> list[int]:
    """What a finished request does: take pages for every token (partial tail included), hand them to the cache."""
    page_ids = allocator.alloc(-(-len(token_ids) // cache.page_size))
    assert page_ids is not None
    cache.insert(token_ids, page_ids)
    return page_ids


def replay(events: list[KVEvent]) -> set[tuple[int, int]]:
    """A router's view built only from events, as (parent_hash, block_hash) pairs."""
    parent_by_hash: dict[int, int] = {}
    for event in events:
        if event.kind == "stored":
            parent = event.parent_hash
            for block_hash in event.block_hashes:
                parent_by_hash[block_hash] = parent
                parent = block_hash
        elif event.kind == "removed":
            for block_hash in event.block_hashes:
                del parent_by_hash[block_hash]
        else:
            parent_by_hash.clear()
    return {(parent_hash, block_hash) for block_hash, parent_hash in parent_by_hash.items()}


def test_match_after_insert_returns_the_inserted_pages():
    allocator, cache, _ = make_cache()
    tokens = list(range(12))
    page_ids = compute_and_insert(allocator, cache, tokens)
    match = cache.match_prefix(tokens + [99, 98])
    assert match.page_ids == page_ids and match.num_tokens == 12
    partial = cache.match_prefix(tokens[:8] + [7, 7, 7, 7])
    assert partial.page_ids == page_ids[:2] and partial.num_tokens == 8
    assert cache.match_prefix([5] + tokens).num_tokens == 0
    cache.check_integrity()


def test_partial_page_tail_is_never_cached():
    allocator, cache, _ = make_cache()
    tokens = list(range(10))  # two full pages and a 2-token tail
    page_ids = compute_and_insert(allocator, cache, tokens)
    assert cache.num_cached_pages == 2
    assert allocator.refcount(page_ids[2]) == 1  # the tail page stays the caller's alone
    assert cache.match_prefix(tokens).num_tokens == 8


def test_insert_with_too_few_pages_raises_and_caches_nothing():
    allocator, cache, _ = make_cache()
    with pytest.raises(ValueError, match="needs >= 3 page ids, got 2"):
        cache.insert(list(range(12)), allocator.alloc(2))
    assert cache.num_cached_pages == 0


def test_insert_of_free_page_raises_and_caches_nothing():
    allocator, cache, _ = make_cache(num_pages=4)
    with pytest.raises(ValueError, match="free"):
        cache.insert(list(range(4)), [3])
    assert cache.num_cached_pages == 0
    cache.check_integrity()


def test_match_locks_pages_until_caller_decrefs():
    allocator, cache, _ = make_cache()
    tokens = list(range(8))
    page_ids = compute_and_insert(allocator, cache, tokens)
    allocator.decref(page_ids)  # request done: only the tree holds them now
    match = cache.match_prefix(tokens)
    assert [allocator.refcount(page_id) for page_id in match.page_ids] == [2, 2]
    assert cache.evict(10) == 0
    assert cache.num_cached_pages == 2
    allocator.decref(match.page_ids)
    assert cache.evict(10) == 2
    assert allocator.num_free == allocator.num_pages


def test_locked_leaf_is_skipped_and_evictable_once_released():
    allocator, cache, events = make_cache()
    locked_tokens, free_tokens = [1] * 4, [2] * 4
    for tokens in (locked_tokens, free_tokens):
        allocator.decref(compute_and_insert(allocator, cache, tokens))
    lock = cache.match_prefix(locked_tokens)
    allocator.decref(cache.match_prefix(free_tokens).page_ids)  # the locked page is now the older leaf
    assert cache.evict(1) == 1
    assert events[-1].block_hashes == prefix_page_hashes(free_tokens, PAGE_SIZE)
    assert cache.evict(1) == 0
    allocator.decref(lock.page_ids)
    assert cache.evict(1) == 1
    assert events[-1].block_hashes == prefix_page_hashes(locked_tokens, PAGE_SIZE)
    cache.check_integrity()


def test_eviction_takes_least_recently_used_leaf_first():
    allocator, cache, events = make_cache()
    prompts = [[prompt_index] * 4 for prompt_index in range(3)]
    for tokens in prompts:
        allocator.decref(compute_and_insert(allocator, cache, tokens))
    allocator.decref(cache.match_prefix(prompts[0]).page_ids)  # prompt 1 is now the oldest, then 2
    assert cache.evict(1) == 1
    assert events[-1].block_hashes == prefix_page_hashes(prompts[1], PAGE_SIZE)
    assert cache.evict(1) == 1
    assert events[-1].block_hashes == prefix_page_hashes(prompts[2], PAGE_SIZE)
    assert cache.match_prefix(prompts[0]).num_tokens == 4


def test_eviction_frees_parent_after_its_children():
    allocator, cache, events = make_cache()
    shared = [7] * 4
    branch_a, branch_b = shared + [1] * 4, shared + [2] * 4
    allocator.decref(compute_and_insert(allocator, cache, branch_a))
    allocator.decref(compute_and_insert(allocator, cache, branch_b))
    assert cache.evict(3) == 3
    hashes_a, hashes_b = prefix_page_hashes(branch_a, PAGE_SIZE), prefix_page_hashes(branch_b, PAGE_SIZE)
    assert events[-1].block_hashes == [hashes_a[1], hashes_b[1], hashes_a[0]]
    assert cache.num_cached_pages == 0 and allocator.num_free == allocator.num_pages


def test_evict_stops_at_requested_count():
    allocator, cache, _ = make_cache()
    allocator.decref(compute_and_insert(allocator, cache, list(range(20))))
    assert cache.evict(2) == 2
    assert cache.match_prefix(list(range(20))).num_tokens == 12


def test_evicting_thousands_of_pages_follows_last_use_order():
    num_prompts = 3000
    allocator, cache, events = make_cache(num_pages=2 * num_prompts)
    prompts = [[prompt_index] * 2 * PAGE_SIZE for prompt_index in range(num_prompts)]
    for tokens in prompts:
        allocator.decref(compute_and_insert(allocator, cache, tokens))
    use_order = random.Random(0).sample(range(num_prompts), num_prompts)
    for prompt_index in use_order:
        allocator.decref(cache.match_prefix(prompts[prompt_index]).page_ids)
    assert cache.evict(2 * num_prompts) == 2 * num_prompts
    expected = [h for prompt_index in use_order for h in reversed(prefix_page_hashes(prompts[prompt_index], PAGE_SIZE))]
    assert events[-1].block_hashes == expected
    assert allocator.num_free == allocator.num_pages


def test_duplicate_insert_keeps_original_pages_and_leaks_nothing():
    allocator, cache, events = make_cache()
    tokens = list(range(10))
    first = compute_and_insert(allocator, cache, tokens)
    second = compute_and_insert(allocator, cache, tokens)  # computed again without a prefix match
    assert len(events) == 1  # the duplicate adds no nodes, so no event
    assert cache.match_prefix(tokens).page_ids == first[:2]
    assert all(allocator.refcount(page_id) == 1 for page_id in second)  # never adopted
    allocator.decref(first[:2])  # the match above
    allocator.decref(first + second)
    assert allocator.num_used == cache.num_cached_pages == 2
    cache.clear()
    assert allocator.num_free == allocator.num_pages


def test_insert_extending_a_matched_prefix_adds_only_new_pages():
    allocator, cache, events = make_cache()
    allocator.decref(compute_and_insert(allocator, cache, list(range(8))))
    longer = list(range(16))
    match = cache.match_prefix(longer[:-1])
    page_ids = match.page_ids + allocator.alloc(2)
    assert cache.insert(longer, page_ids) == 2
    assert events[-1].parent_hash == prefix_page_hashes(longer, PAGE_SIZE)[1]
    assert events[-1].block_hashes == prefix_page_hashes(longer, PAGE_SIZE)[2:]


def test_event_hashes_equal_prefix_page_hashes():
    allocator, cache, events = make_cache()
    tokens = list(range(13))
    allocator.decref(compute_and_insert(allocator, cache, tokens))
    assert events == [KVEvent(kind="stored", block_hashes=prefix_page_hashes(tokens, PAGE_SIZE), parent_hash=ROOT_HASH)]
    cache.evict(100)
    assert events[-1].kind == "removed"
    assert set(events[-1].block_hashes) == set(prefix_page_hashes(tokens, PAGE_SIZE))


def test_clear_drops_tree_references_but_not_callers():
    allocator, cache, events = make_cache()
    tokens = list(range(8))
    allocator.decref(compute_and_insert(allocator, cache, tokens))
    match = cache.match_prefix(tokens)
    cache.clear()
    assert events[-1] == KVEvent(kind="cleared")
    assert cache.num_cached_pages == 0 and cache.stored_blocks() == []
    assert [allocator.refcount(page_id) for page_id in match.page_ids] == [1, 1]
    allocator.decref(match.page_ids)
    assert allocator.num_free == allocator.num_pages
    cache.check_integrity()


def test_stored_blocks_lists_parents_first_and_matches_replayed_events():
    allocator, cache, events = make_cache()
    for tokens in ([1] * 12, [1] * 8 + [2] * 4, [3] * 8):
        allocator.decref(compute_and_insert(allocator, cache, tokens))
    cache.evict(1)
    blocks = cache.stored_blocks()
    seen = {ROOT_HASH}
    for parent_hash, block_hash in blocks:
        assert parent_hash in seen
        seen.add(block_hash)
    assert set(blocks) == replay(events)
    assert len(blocks) == cache.num_cached_pages == 5


class ReferenceCache:
    """The slow, obviously correct twin: every cached prefix in a dict, eviction by scanning all of them."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.page_by_prefix: dict[tuple[int, ...], int] = {}
        self.last_access: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def full_prefixes(self, token_ids):
        return [tuple(token_ids[:end]) for end in range(self.page_size, len(token_ids) + 1, self.page_size)]

    def touch(self, prefixes):
        if prefixes:
            self.clock += 1
            for prefix in prefixes:
                self.last_access[prefix] = self.clock

    def match(self, token_ids) -> list[int]:
        path = []
        for prefix in self.full_prefixes(token_ids):
            if prefix not in self.page_by_prefix:
                break
            path.append(prefix)
        self.touch(path)
        return [self.page_by_prefix[prefix] for prefix in path]

    def insert(self, token_ids, page_ids) -> int:
        prefixes = self.full_prefixes(token_ids)
        added = 0
        for prefix, page_id in zip(prefixes, page_ids):
            if prefix not in self.page_by_prefix:
                self.page_by_prefix[prefix] = page_id
                added += 1
        self.touch(prefixes)
        return added

    def has_child(self, prefix) -> bool:
        return any(len(other) > len(prefix) and other[: len(prefix)] == prefix for other in self.page_by_prefix)

    def evict(self, num_pages, refcount) -> list[int]:
        evicted = []
        while len(evicted) < num_pages:
            candidates = [
                prefix
                for prefix, page_id in self.page_by_prefix.items()
                if refcount(page_id) == 1 and not self.has_child(prefix)
            ]
            if not candidates:
                break
            oldest = min(candidates, key=self.last_access.__getitem__)
            del self.page_by_prefix[oldest]
            evicted.append(prefix_page_hashes(list(oldest), self.page_size)[-1])
        return evicted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_agree_with_reference_model(seed):
    rng = random.Random(seed)
    page_size, num_pages = 2, 24
    allocator, cache, events = make_cache(num_pages, page_size)
    model = ReferenceCache(page_size)
    base_prompts = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    live_requests: list[list[int]] = []

    def evict_both(num_to_evict):
        before = len(events)
        expected = model.evict(num_to_evict, allocator.refcount)
        assert cache.evict(num_to_evict) == len(expected)
        removed = [h for event in events[before:] for h in event.block_hashes]
        assert removed == expected

    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            tail = [rng.randrange(3) for _ in range(rng.randrange(4))]
            tokens = rng.choice(base_prompts)[: rng.randrange(1, 13)] + tail
            if rng.random() < 0.8:
                held = cache.match_prefix(tokens[:-1]).page_ids
                assert held == model.match(tokens[:-1])
            else:
                held = []  # computed from scratch, so its insert duplicates cached pages
            num_needed = -(-len(tokens) // page_size) - len(held)
            if allocator.num_free < num_needed:
                evict_both(num_needed - allocator.num_free)
            fresh = allocator.alloc(num_needed)
            if fresh is None:
                allocator.decref(held)
            else:
                if rng.random() < 0.8:
                    assert cache.insert(tokens, held + fresh) == model.insert(tokens, held + fresh)
                live_requests.append(held + fresh)
        elif op < 0.8 and live_requests:
            allocator.decref(live_requests.pop(rng.randrange(len(live_requests))))
        elif op < 0.98:
            evict_both(rng.randrange(1, 5))
        else:
            cache.clear()
            model = ReferenceCache(page_size)

        cache.check_integrity()
        caller_refs = Counter(page_id for page_ids in live_requests for page_id in page_ids)
        tree_pages = set(model.page_by_prefix.values())
        for page_id in range(num_pages):
            assert allocator.refcount(page_id) == caller_refs[page_id] + (page_id in tree_pages)
        blocks = cache.stored_blocks()
        assert set(blocks) == replay(events)
        assert {block_hash for _, block_hash in blocks} == {
            prefix_page_hashes(list(prefix), page_size)[-1] for prefix in model.page_by_prefix
        }

    for page_ids in live_requests:
        allocator.decref(page_ids)
    cache.clear()
    assert allocator.num_free == num_pages
