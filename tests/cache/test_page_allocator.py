import random

import pytest

from pdserve.cache.page_allocator import PageAllocator
from pdserve.transfer.layout import page_runs


def test_alloc_hands_out_distinct_pages_with_refcount_one():
    allocator = PageAllocator(8)
    page_ids = allocator.alloc(5)
    assert page_ids is not None and len(set(page_ids)) == 5
    assert all(allocator.refcount(page_id) == 1 for page_id in page_ids)
    assert (allocator.num_free, allocator.num_used) == (3, 5)


def test_alloc_beyond_free_returns_none_and_takes_nothing():
    allocator = PageAllocator(4)
    assert allocator.alloc(3) is not None
    assert allocator.alloc(2) is None
    assert allocator.num_free == 1
    assert allocator.alloc(1) is not None
    assert allocator.alloc(0) == []


def test_page_returns_to_free_list_only_when_last_reference_drops():
    allocator = PageAllocator(2)
    [page_id] = allocator.alloc(1)
    allocator.incref([page_id])
    allocator.decref([page_id])
    assert allocator.refcount(page_id) == 1 and allocator.num_free == 1
    allocator.decref([page_id])
    assert allocator.refcount(page_id) == 0 and allocator.num_free == 2
    assert sorted(allocator.alloc(2)) == [0, 1]


def test_repeated_ids_in_one_call_count_each_time():
    allocator = PageAllocator(2)
    [page_id] = allocator.alloc(1)
    allocator.incref([page_id, page_id])
    assert allocator.refcount(page_id) == 3
    allocator.decref([page_id, page_id, page_id])
    assert allocator.num_free == 2


def test_decref_of_free_page_raises_and_changes_nothing():
    allocator = PageAllocator(3)
    [held] = allocator.alloc(1)
    free_page = next(page_id for page_id in range(3) if page_id != held)
    with pytest.raises(ValueError, match="free"):
        allocator.decref([held, free_page])
    assert allocator.refcount(held) == 1
    with pytest.raises(ValueError, match="reference count is 1"):
        allocator.decref([held, held])
    assert allocator.refcount(held) == 1


def test_incref_of_free_page_raises():
    allocator = PageAllocator(2)
    with pytest.raises(ValueError, match="free"):
        allocator.incref([0])


@pytest.mark.parametrize("bad_id", [-1, 4, 1.0, "0"])
def test_bad_page_ids_raise_with_the_valid_range(bad_id):
    allocator = PageAllocator(4)
    allocator.alloc(4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        allocator.refcount(bad_id)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        allocator.decref([bad_id])


def test_negative_alloc_raises():
    with pytest.raises(ValueError, match=">= 0"):
        PageAllocator(4).alloc(-1)


def test_pages_freed_in_any_order_go_out_again_as_one_ascending_run():
    """A KV transfer moves each run of consecutive pages with one descriptor: freed pages must not come back
    reversed or interleaved (a stack of freed pages handed out 41, 40, 39, ...: one descriptor per page)."""
    allocator = PageAllocator(64)
    first, second = allocator.alloc(16), allocator.alloc(16)
    allocator.decref(reversed(first))
    allocator.decref(second[::2] + second[1::2])
    again = allocator.alloc(32)
    assert again == list(range(32))
    assert len(page_runs(again, allocator.alloc(32))) == 1


def test_a_request_gets_the_lowest_free_run_long_enough_past_lower_holes():
    allocator = PageAllocator(32)
    held = allocator.alloc(32)
    allocator.decref([held[i] for i in (1, 2, 5, 6, 7)] + held[10:20] + held[24:30])
    assert allocator.alloc(3) == [5, 6, 7]  # not 1, 2, 5
    assert allocator.alloc(8) == list(range(10, 18))
    assert allocator.alloc(7) == [1, 2, 18, 19, 24, 25, 26]  # no run of 7 is left: lowest first
    assert allocator.num_free == 3


def test_allocations_match_a_plain_scan_under_random_use():
    """The byte-map search against the obvious twin: scan for the lowest run of n free pages, else the n lowest."""
    rng = random.Random(3)
    allocator, free, held = PageAllocator(200), [True] * 200, []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            pages = held.pop(rng.randrange(len(held)))
            allocator.decref(pages)
            for page in pages:
                free[page] = True
            continue
        n = rng.choice((1, 1, 2, 5, 17, 40))
        runs = [s for s in range(200 - n + 1) if all(free[s : s + n])]
        expected = list(range(runs[0], runs[0] + n)) if runs else [p for p in range(200) if free[p]][:n]
        got = allocator.alloc(n)
        if len(expected) < n:
            assert got is None
            continue
        assert got == expected
        for page in got:
            free[page] = False
        held.append(got)
        assert allocator.num_free == sum(free)
