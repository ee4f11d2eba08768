import random

from pdserve.wire.block_hash import prefix_page_hashes
from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import KVEventBatch
from pdserve_router.prefix_index import PrefixIndex

PAGE = 4
RANK = ("http://w", 0)
PROMPT = list(range(1, 18))  # 4 full pages + 1 token
HASHES = prefix_page_hashes(PROMPT, PAGE)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fresh_index(clock=None) -> PrefixIndex:
    index = PrefixIndex(pending_ttl_s=5.0, clock=clock or FakeClock())
    index.add_rank(RANK, PAGE)
    index.apply(RANK, KVEventBatch(rank=0, seq=10, events=[KVEvent("cleared")]))  # the full dump: empty rank
    return index


def matched(index: PrefixIndex, prompt=PROMPT) -> int:
    return index.matched_tokens(prompt).get(RANK, 0)


def test_stored_events_give_the_contiguous_matched_prefix():
    index = fresh_index()
    index.apply(RANK, KVEventBatch(0, 11, [KVEvent("stored", HASHES[:3], parent_hash=0)]))
    assert matched(index) == 3 * PAGE
    assert matched(index, PROMPT[:9] + [999] * 8) == 2 * PAGE  # diverges inside page 3


def test_removed_page_cuts_the_match_at_that_page():
    index = fresh_index()
    index.apply(RANK, KVEventBatch(0, 11, [KVEvent("stored", HASHES, parent_hash=0)]))
    index.apply(RANK, KVEventBatch(0, 12, [KVEvent("removed", [HASHES[1]])]))
    assert matched(index) == PAGE


def test_own_assignment_counts_until_it_expires():
    clock = FakeClock()
    index = fresh_index(clock)
    index.record_assignment(RANK, PROMPT)
    assert matched(index) == 4 * PAGE
    clock.now += 6.0
    assert matched(index) == 0


def test_seq_gap_empties_the_rank_and_asks_for_a_full_dump():
    index = fresh_index()
    index.apply(RANK, KVEventBatch(0, 11, [KVEvent("stored", HASHES, parent_hash=0)]))
    assert index.apply(RANK, KVEventBatch(0, 13, [KVEvent("stored", [123])])) == "gap"
    assert matched(index) == 0 and index.subscribe_after(RANK) == -1
    # Live batches before the dump are ignored; the dump (cleared + stored) restores the rank whatever its seq.
    assert index.apply(RANK, KVEventBatch(0, 14, [KVEvent("stored", HASHES, parent_hash=0)])) == "skipped"
    assert matched(index) == 0
    dump = KVEventBatch(0, 20, [KVEvent("cleared"), KVEvent("stored", HASHES[:2], parent_hash=0)])
    assert index.apply(RANK, dump) == "applied"
    assert matched(index) == 2 * PAGE and index.subscribe_after(RANK) == 20
    index.apply(RANK, KVEventBatch(0, 21, [KVEvent("stored", HASHES[2:], parent_hash=HASHES[1])]))
    assert matched(index) == 4 * PAGE


def test_replayed_batches_are_not_applied_twice():
    index = fresh_index()
    index.apply(RANK, KVEventBatch(0, 11, [KVEvent("stored", HASHES, parent_hash=0)]))
    index.apply(RANK, KVEventBatch(0, 12, [KVEvent("removed", HASHES)]))
    assert index.apply(RANK, KVEventBatch(0, 11, [KVEvent("stored", HASHES, parent_hash=0)])) == "skipped"
    assert matched(index) == 0


def test_batches_of_an_unknown_rank_change_nothing():
    index = fresh_index()
    assert index.apply(("http://gone", 0), KVEventBatch(0, 1, [KVEvent("cleared"), KVEvent("stored", HASHES)])) == "skipped"
    assert ("http://gone", 0) not in index.ranks


def test_ranks_with_different_page_sizes_are_matched_with_their_own_hashes():
    index = fresh_index()
    other = ("http/other", 1)
    index.add_rank(other, 8)
    index.apply(other, KVEventBatch(1, 0, [KVEvent("cleared"), KVEvent("stored", prefix_page_hashes(PROMPT, 8))]))
    assert index.matched_tokens(PROMPT) == {other: 16}  # RANK holds none of it: left out


class ReferenceIndex:
    """The obvious twin: per rank, a set of stored hashes and pending hashes with expiries, probed page by page."""

    def __init__(self, clock: FakeClock, ttl_s: float) -> None:
        self.clock, self.ttl_s = clock, ttl_s
        self.ranks: dict = {}  # key -> (page_size, stored set, pending dict)

    def matched_tokens(self, prompt: list[int]) -> dict:
        matched = {}
        for key, (page_size, stored, pending) in self.ranks.items():
            pages = 0
            for page_hash in prefix_page_hashes(prompt, page_size):
                if page_hash not in stored and pending.get(page_hash, 0.0) <= self.clock.now:
                    break
                pages += 1
            if pages:
                matched[key] = pages * page_size
        return matched


def test_the_mask_index_matches_per_rank_sets_under_random_events():
    rng = random.Random(7)
    clock = FakeClock()
    index, reference = PrefixIndex(pending_ttl_s=5.0, clock=clock), ReferenceIndex(clock, 5.0)
    prompts = [[g] * 4 + list(range(100 * g, 100 * g + rng.randrange(4, 30))) for g in range(6)]
    prompts += [p[:10] + [999] * 8 for p in prompts[:3]]  # share a start with another prompt, then diverge
    keys = [(f"http://w{w}", r) for w in range(4) for r in range(3)]
    seq = {}
    for step in range(3000):
        key = rng.choice(keys)
        action = rng.random()
        if key not in reference.ranks or action < 0.02:  # (re)join, sometimes with another page size
            page_size = rng.choice((4, 4, 8))
            if key in reference.ranks and reference.ranks[key][0] == page_size:
                continue
            index.add_rank(key, page_size)
            index.apply(key, KVEventBatch(key[1], 0, [KVEvent("cleared")]))
            reference.ranks[key] = (page_size, set(), {})
            seq[key] = 0
            continue
        page_size, stored, pending = reference.ranks[key]
        hashes = prefix_page_hashes(rng.choice(prompts), page_size)
        picked = hashes[: rng.randrange(len(hashes) + 1)]
        if action < 0.04:
            index.remove_rank(key)
            del reference.ranks[key]
        elif action < 0.3:
            prompt = rng.choice(prompts)
            index.record_assignment(key, prompt)
            pending.update(dict.fromkeys(prefix_page_hashes(prompt, page_size), clock.now + 5.0))
        elif action < 0.6:
            seq[key] += 1
            index.apply(key, KVEventBatch(key[1], seq[key], [KVEvent("stored", picked)]))
            stored.update(picked)
            for page_hash in picked:
                pending.pop(page_hash, None)
        elif action < 0.8:
            seq[key] += 1
            removed = rng.sample(sorted(stored), min(len(stored), rng.randrange(3))) if stored else []
            index.apply(key, KVEventBatch(key[1], seq[key], [KVEvent("removed", removed)]))
            stored.difference_update(removed)
        elif action < 0.82:
            seq[key] += 1
            index.apply(key, KVEventBatch(key[1], seq[key], [KVEvent("cleared")]))
            stored.clear()
        else:
            clock.now += rng.choice((0.1, 0.5, 2.0))
        for prompt in rng.sample(prompts, 3):
            assert index.matched_tokens(prompt) == reference.matched_tokens(prompt), step
