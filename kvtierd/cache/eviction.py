"""Eviction policies: which idle cached page allocation reuses next.

The block pool hands a policy every cached page whose last reference goes
(`add`), takes it back when a request adopts it again, it expires or its
namespace is invalidated (`discard`), and asks for the next victim when no
never-used page is left (`pop`). Never-used pages (no hash) are the pool's
business and always go first; a policy only orders pages worth keeping.

Tail before head, whatever the policy: a page is never chosen while a later
page of its chain (one whose parent hash is this page's hash) is idle here.
Lookups stop at the first missing page, so evicting a head would strand its
tail: cached, but unreachable.

    lru   least recently released first; O(1). A released page whose chain's
          earlier pages are already idle moves them behind itself (using a
          page uses its prefix), which keeps tails first.
    lfu   fewest hits first, ties least recently released; O(log n).
    cost  lowest hits * (1 + depth) first, ties least recently released;
          O(log n). Recomputing page i of a chain attends over the i pages
          before it, so its cost grows with its depth; every page frees the
          same bytes, so this is the value kept per byte. A page never hit
          scores 0 whatever its depth: there is no sign it will be asked for.

lfu and cost offer only leaves (idle pages with no idle page after them in
their chain) to a heap with lazy invalidation; a page's parent becomes a
leaf when its last idle child leaves.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.page_remap import PageRemap

if TYPE_CHECKING:
    from kvtierd.cache.retention import RetainedUntil

EVICTION_POLICIES = ("lru", "lfu", "cost")


@dataclass(slots=True)
class IdlePage:
    """What a policy knows of an idle cached page (fixed while it stays idle)."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None  # the previous page's hash in its chain; None for a chain's first page
    depth: int  # position in its chain: 0 for the first page
    hits: int  # times a request adopted it from the cache
    released: int  # release order: larger is more recent
    root: BlockHash = BlockHash(b"")  # its namespace (tenant): cache shares order tenants by it
    retained: RetainedUntil | None = None  # a soft-retention hint still running when it went idle (cache/retention.py)

    def copy(self) -> IdlePage:
        """Its own copy for a policy inside another (a remap renames each policy's pages once); written out:
        `dataclasses.replace` took several microseconds a page, twice for each of a long prompt's pages going
        idle in the step that finished it."""
        return IdlePage(self.block_id, self.block_hash, self.parent_hash, self.depth, self.hits, self.released,
                        self.root, self.retained)


@dataclass(slots=True)
class EvictionCounts:
    """Pages dropped from the prefix index, by reason."""

    capacity: int = 0  # taken by allocation
    expired: int = 0  # idle for longer than prefix_ttl_s
    invalidated: int = 0  # their namespace or prefix was dropped on request


class EvictionPolicy(ABC):
    name: str

    def __init__(self) -> None:
        self._pages: dict[int, IdlePage] = {}
        self._by_hash: dict[BlockHash, int] = {}  # idle page of each hash

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._pages

    def add(self, page: IdlePage) -> None:
        assert page.block_id not in self._pages, f"page {page.block_id} is already idle"
        self._pages[page.block_id] = page
        self._by_hash[page.block_hash] = page.block_id
        self._added(page)

    def discard(self, block_id: int) -> None:
        page = self._pages.pop(block_id)
        del self._by_hash[page.block_hash]
        self._removed(page)

    def pop(self) -> int:
        """The page to reuse next (there must be one); it leaves the policy."""
        assert self._pages, "no idle cached page to evict"
        block_id = self._choose()
        self.discard(block_id)
        return block_id

    def remap(self, remap: PageRemap) -> None:
        """Renames every page as compaction says; the order pages go in stays as it was."""
        for page in self._pages.values():
            page.block_id = remap[page.block_id]
        self._pages = {page.block_id: page for page in self._pages.values()}
        self._by_hash = remap.values(self._by_hash)
        self._remapped(remap)

    def _idle_parent(self, page: IdlePage) -> IdlePage | None:
        if page.parent_hash is None:
            return None
        b = self._by_hash.get(page.parent_hash)
        parent = None if b is None else self._pages[b]
        # A chain's depth falls by one per step back, so walking parents always ends.
        return parent if parent is not None and parent.depth == page.depth - 1 else None

    @abstractmethod
    def _added(self, page: IdlePage) -> None: ...

    @abstractmethod
    def _removed(self, page: IdlePage) -> None: ...

    @abstractmethod
    def _choose(self) -> int: ...

    @abstractmethod
    def _remapped(self, remap: PageRemap) -> None: ...


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._queue: OrderedDict[int, None] = OrderedDict()  # head: next to go

    def _added(self, page: IdlePage) -> None:
        self._queue[page.block_id] = None
        # Released chains come tail first, so this walk is empty unless a
        # prefix went idle before its tail (it was computed by another request).
        parent = self._idle_parent(page)
        while parent is not None:
            self._queue.move_to_end(parent.block_id)
            parent = self._idle_parent(parent)

    def _removed(self, page: IdlePage) -> None:
        del self._queue[page.block_id]

    def _choose(self) -> int:
        return next(iter(self._queue))

    def _remapped(self, remap: PageRemap) -> None:
        self._queue = remap.order(self._queue)


class _LeafHeapPolicy(EvictionPolicy):
    """Leaves in a heap by `key`, least first; stale entries are skipped on pop."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[tuple[int, int], int, int]] = []  # (key, entry id, page)
        self._entry_of: dict[int, int] = {}  # leaf page -> its live entry id
        # (hash, depth) of a page -> how many idle pages follow it in its chain
        self._idle_children: dict[tuple[BlockHash, int], int] = {}
        self._entry_ids = itertools.count()

    @staticmethod
    @abstractmethod
    def key(page: IdlePage) -> tuple[int, int]: ...

    def _added(self, page: IdlePage) -> None:
        if page.parent_hash is not None:
            link = (page.parent_hash, page.depth - 1)
            n = self._idle_children.get(link, 0)
            self._idle_children[link] = n + 1
            parent = self._idle_parent(page)
            if n == 0 and parent is not None:
                self._entry_of.pop(parent.block_id, None)  # no longer a leaf
        if (page.block_hash, page.depth) not in self._idle_children:
            self._offer(page)

    def _removed(self, page: IdlePage) -> None:
        self._entry_of.pop(page.block_id, None)
        if page.parent_hash is not None:
            link = (page.parent_hash, page.depth - 1)
            n = self._idle_children[link] - 1
            if n:
                self._idle_children[link] = n
            else:
                del self._idle_children[link]
                parent = self._idle_parent(page)
                if parent is not None:
                    self._offer(parent)

    def _offer(self, page: IdlePage) -> None:
        entry = next(self._entry_ids)
        self._entry_of[page.block_id] = entry
        heapq.heappush(self._heap, (self.key(page), entry, page.block_id))
        if len(self._heap) > 2 * len(self._entry_of) + 64:  # mostly stale: rebuild
            self._heap = [e for e in self._heap if self._entry_of.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def _choose(self) -> int:
        while True:
            _, entry, b = heapq.heappop(self._heap)
            if self._entry_of.get(b) == entry:
                return b

    def _remapped(self, remap: PageRemap) -> None:
        # Entry ids are unique, so no comparison reaches the page: the heap stays a heap.
        self._heap = [(key, entry, remap[b]) for key, entry, b in self._heap]
        self._entry_of = remap.keys(self._entry_of)


class LFUPolicy(_LeafHeapPolicy):
    name = "lfu"

    @staticmethod
    def key(page: IdlePage) -> tuple[int, int]:
        return (page.hits, page.released)


class CostPolicy(_LeafHeapPolicy):
    name = "cost"

    @staticmethod
    def key(page: IdlePage) -> tuple[int, int]:
        """hits * (1 + depth): the recompute work a page saves; lowest goes first."""
        return (page.hits * (1 + page.depth), page.released)


def make_policy(name: str) -> EvictionPolicy:
    policies: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy, "cost": CostPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(EVICTION_POLICIES)}")
    return policies[name]()
