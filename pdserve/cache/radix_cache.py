"""Prefix tree of cached KV pages of one rank: finds reusable prefixes, adopts finished pages, evicts LRU leaves.

One node is one full page of `page_size` tokens; a node's children are keyed by their page's token tuple. The tree
holds one allocator reference per node, so a page whose count is above 1 is also held by a request ("locked").
With a host tier, evicted pages move there and come back when a prompt continues past the tree; the events then say
what the rank holds in either tier.
"""

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.cache.host_tier import EvictedPage, HostTier
from pdserve.cache.page_allocator import PageAllocator
from pdserve.wire.block_hash import ROOT_HASH, page_hash
from pdserve.wire.kv_events import KVEvent


@dataclass(frozen=True)
class PrefixMatch:
    """Cached pages covering the first `num_tokens` tokens; the caller owns one reference to each."""

    page_ids: list[int]
    num_tokens: int


@dataclass(eq=False)
class _Node:
    page_tokens: tuple[int, ...]
    page_id: int
    block_hash: int
    parent: "_Node | None"
    last_access: int
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    in_tree: bool = True


class RadixCache:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        host_tier: HostTier | None = None,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.host_tier = host_tier
        self._on_events = on_events
        self._root = _Node(page_tokens=(), page_id=-1, block_hash=ROOT_HASH, parent=None, last_access=0)
        self._node_by_page_id: dict[int, _Node] = {}
        self._hashes_in_tree: set[int] = set()  # a page the host tier drops is gone only if the tree lacks it too
        self._clock = 0
        # Min-heap of (last_access, tiebreak, node) for leaves. Entries go stale when a leaf is touched, gains a
        # child or leaves the tree; they are skipped on pop instead of being searched for and removed.
        self._leaf_heap: list[tuple[int, int, _Node]] = []
        self._tiebreak = itertools.count()

    @property
    def num_cached_pages(self) -> int:
        return len(self._node_by_page_id)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached run of full pages starting at token 0; increfs each returned page for the caller.
        Pages past the tree's that the host tier holds are copied into new device pages and join the tree."""
        path = self._walk(token_ids)
        self._touch(path)
        page_ids = [node.page_id for node in path]
        self.allocator.incref(page_ids)
        if self.host_tier is not None:
            page_ids += self._load_from_host(token_ids, path)
        return PrefixMatch(page_ids=page_ids, num_tokens=len(page_ids) * self.page_size)

    def _load_from_host(self, token_ids: Sequence[int], path: list["_Node"]) -> list[int]:
        """Device pages holding the host tier's continuation of `path` (one reference each for the caller), or none
        where the pool cannot make room for all of them."""
        host = self.host_tier
        parent = path[-1] if path else self._root
        block_hashes = host.find(parent.block_hash, token_ids, len(path), self.page_size)
        if not block_hashes:
            return []
        with host.pinned(block_hashes):  # making room may evict into the host tier; the path itself is locked
            page_ids = self.alloc_or_evict(len(block_hashes))
        if page_ids is None:
            return []
        host.load(block_hashes, page_ids)
        num_tokens = (len(path) + len(page_ids)) * self.page_size
        self.insert(token_ids[:num_tokens], [node.page_id for node in path] + page_ids)
        return page_ids

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> int:
        """Cache the full pages of `token_ids`, held in `page_ids`; returns how many pages the tree adopted.

        Pages the tree already holds for this prefix win: the caller's copies are not adopted and remain the
        caller's to decref. Each adopted page gets one extra reference, owned by the tree.
        """
        num_full_pages = len(token_ids) // self.page_size
        if len(page_ids) < num_full_pages:
            raise ValueError(
                f"insert of {len(token_ids)} tokens needs >= {num_full_pages} page ids, got {len(page_ids)}"
            )
        path = self._walk(token_ids)
        new_page_ids = list(page_ids[len(path) : num_full_pages])
        for page_id in new_page_ids:
            if page_id in self._node_by_page_id:
                raise ValueError(f"insert expects pages the tree does not hold, but page {page_id} is already cached")
        if len(set(new_page_ids)) != len(new_page_ids):
            raise ValueError(f"insert expects distinct page ids, got {new_page_ids}")
        self.allocator.incref(new_page_ids)  # also rejects free or out-of-range ids before the tree changes

        parent = path[-1] if path else self._root
        first_parent_hash = parent.block_hash
        new_nodes = []
        for page_index, page_id in enumerate(new_page_ids, start=len(path)):
            page_tokens = self._page_tokens(token_ids, page_index)
            node = _Node(
                page_tokens=page_tokens,
                page_id=page_id,
                block_hash=page_hash(parent.block_hash, list(page_tokens)),
                parent=parent,
                last_access=0,  # set by _touch below, together with the existing path
            )
            parent.children[page_tokens] = node
            self._node_by_page_id[page_id] = node
            self._hashes_in_tree.add(node.block_hash)
            new_nodes.append(node)
            parent = node
        self._touch(path + new_nodes)
        if new_nodes:
            new_hashes = [node.block_hash for node in new_nodes]
            self._emit(KVEvent(kind="stored", block_hashes=new_hashes, parent_hash=first_parent_hash))
        return len(new_page_ids)

    def alloc_or_evict(self, num_pages: int) -> list[int] | None:
        """`num_pages` pages from the allocator, evicting unused cached pages for them if needed; None if even that
        leaves too few."""
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            self.evict(num_pages - self.allocator.num_free)
            pages = self.allocator.alloc(num_pages)
        return pages

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages held only by the tree, least recently used leaves first; returns how many.

        Cost: O((evicted + locked leaves met) * log(heap size)).
        """
        locked_leaves: dict[int, _Node] = {}
        removed: list[_Node] = []
        while len(removed) < num_pages and self._leaf_heap:
            last_access, _, node = heapq.heappop(self._leaf_heap)
            if not self._is_current_leaf_entry(node, last_access):
                continue
            if self.allocator.refcount(node.page_id) > 1:
                locked_leaves[id(node)] = node  # in use now; back in the heap so a later evict can retry it
                continue
            self._remove_leaf(node)
            removed.append(node)
            parent = node.parent
            if parent is not self._root and not parent.children:
                self._push_leaf(parent)
        for node in locked_leaves.values():
            self._push_leaf(node)
        # The freed ids are reused only after this returns, and the host tier's copy is enqueued before then.
        gone = [node.block_hash for node in removed] if self.host_tier is None else [
            block_hash for block_hash in self.host_tier.keep(
                [EvictedPage(node.block_hash, node.parent.block_hash, node.page_tokens, node.page_id)
                 for node in removed])
            if block_hash not in self._hashes_in_tree]
        if gone:
            self._emit(KVEvent(kind="removed", block_hashes=gone))
        return len(removed)

    def clear(self) -> None:
        """Drop the tree's reference to every page; pages still held by requests stay allocated to them."""
        self.allocator.decref(self._node_by_page_id.keys())
        for node in self._node_by_page_id.values():
            node.in_tree = False
        self._node_by_page_id.clear()
        self._hashes_in_tree.clear()
        self._root.children.clear()
        self._leaf_heap.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        self._emit(KVEvent(kind="cleared"))

    def stored_blocks(self) -> list[tuple[int, int]]:
        """(parent_hash, block_hash) of every cached page, the tree's parents before children, then the host tier's
        pages the tree lacks: a full resync for a router."""
        blocks = []
        frontier = [self._root]
        while frontier:
            node = frontier.pop()
            for child in node.children.values():
                blocks.append((node.block_hash, child.block_hash))
                frontier.append(child)
        if self.host_tier is not None:
            blocks += [block for block in self.host_tier.stored_blocks() if block[1] not in self._hashes_in_tree]
        return blocks

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the tree, its page references or its leaf heap is broken."""
        heap_leaf_ids = {
            id(node) for last_access, _, node in self._leaf_heap if self._is_current_leaf_entry(node, last_access)
        }
        seen_page_ids = set()
        frontier = [self._root]
        while frontier:
            parent = frontier.pop()
            for page_tokens, node in parent.children.items():
                _require(node.parent is parent and node.in_tree, f"node of page {node.page_id} is detached")
                _require(node.page_tokens == page_tokens, f"node of page {node.page_id} is keyed by other tokens")
                _require(len(page_tokens) == self.page_size, f"page {node.page_id} holds {len(page_tokens)} tokens")
                _require(
                    node.block_hash == page_hash(parent.block_hash, list(page_tokens)),
                    f"page {node.page_id} has a hash that does not chain from its parent",
                )
                _require(node.page_id not in seen_page_ids, f"page {node.page_id} is in the tree twice")
                _require(
                    self._node_by_page_id.get(node.page_id) is node, f"page {node.page_id} is missing from the index"
                )
                _require(self.allocator.refcount(node.page_id) >= 1, f"cached page {node.page_id} is free")
                _require(
                    node.last_access <= parent.last_access or parent is self._root,
                    f"page {node.page_id} was used after its parent, so LRU could evict the parent first",
                )
                _require(node.children or id(node) in heap_leaf_ids, f"leaf page {node.page_id} is not evictable")
                seen_page_ids.add(node.page_id)
                frontier.append(node)
        _require(
            len(seen_page_ids) == len(self._node_by_page_id) == len(self._hashes_in_tree),
            f"index holds {len(self._node_by_page_id)} pages and {len(self._hashes_in_tree)} hashes, tree holds "
            f"{len(seen_page_ids)}",
        )
        if self.host_tier is not None:
            self.host_tier.check_integrity()

    def _walk(self, token_ids: Sequence[int]) -> list[_Node]:
        path = []
        node = self._root
        for page_index in range(len(token_ids) // self.page_size):
            child = node.children.get(self._page_tokens(token_ids, page_index))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _page_tokens(self, token_ids: Sequence[int], page_index: int) -> tuple[int, ...]:
        start = page_index * self.page_size
        return tuple(map(int, token_ids[start : start + self.page_size]))

    def _touch(self, path: list[_Node]) -> None:
        """Mark a root-to-node path as used now; only its last node can be a leaf, so only it needs a heap entry."""
        if not path:
            return
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        if not path[-1].children:
            self._push_leaf(path[-1])

    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._tiebreak), node))
        # Stale entries pile up under match-heavy load without evictions; rebuild so the heap stays O(tree size).
        if len(self._leaf_heap) > 2 * len(self._node_by_page_id) + 64:
            self._rebuild_leaf_heap()

    def _rebuild_leaf_heap(self) -> None:
        self._leaf_heap = [
            (node.last_access, next(self._tiebreak), node)
            for node in self._node_by_page_id.values()
            if not node.children
        ]
        heapq.heapify(self._leaf_heap)

    def _is_current_leaf_entry(self, node: _Node, last_access: int) -> bool:
        return node.in_tree and not node.children and node.last_access == last_access

    def _remove_leaf(self, node: _Node) -> None:
        del node.parent.children[node.page_tokens]
        del self._node_by_page_id[node.page_id]
        self._hashes_in_tree.discard(node.block_hash)
        node.in_tree = False
        self.allocator.decref([node.page_id])

    def _emit(self, event: KVEvent) -> None:
        if self._on_events is not None:
            self._on_events([event])


def _require(condition: object, message: str) -> None:
    # Explicit raise rather than `assert`, so the check still runs under `python -O`.
    if not condition:
        raise AssertionError(message)


class NullPrefixCache:
    """The prefix cache when prefix caching is off: matches nothing, keeps nothing, emits no events."""

    num_cached_pages = 0
    host_tier = None

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch([], 0)

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> int:
        return 0

    def alloc_or_evict(self, num_pages: int) -> list[int] | None:
        return self.allocator.alloc(num_pages)

    def evict(self, num_pages: int) -> int:
        return 0

    def stored_blocks(self) -> list[tuple[int, int]]:
        return []
