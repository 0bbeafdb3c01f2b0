"""Per-page accounting: reference counts, pins, generations, and the queue of never-used free pages.

A page is free when nobody holds (references) or pins it. A free page with
no hash (never used, or unindexed) waits in `uncached`, taken first by
allocation: reusing it loses nothing. A free page still indexed is idle
cached and waits in the eviction order (`cache/eviction_order.py`) instead;
which of the two queues a page enters is the block pool's call.

Every page has a generation, bumped whenever its contents may change: a
session pool keeps pages it does not hold by (page, generation).

High-class references are counted apart: the reserved region
(`cache/reserved_region.py`) reads the pages the high class holds.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from kvtierd.cache.page_remap import PageRemap


class PageRefs:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.generation = [0] * num_blocks
        self.uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # next to take first
        self.high_refs = [0] * num_blocks  # references held by high-class sequences
        self.num_high_blocks = 0  # pages with at least one
        self.pins: Counter[int] = Counter()  # page -> pins holding it

    def is_free(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0 and block_id not in self.pins

    def take_uncached(self) -> int | None:
        return self.uncached.popitem(last=False)[0] if self.uncached else None

    def put_uncached(self, block_id: int, first: bool = False) -> None:
        self.uncached[block_id] = None
        if first:
            self.uncached.move_to_end(block_id, last=False)

    def hold(self, block_id: int, high: bool) -> None:
        """One more reference (and one more high-class one when `high`)."""
        self.ref_counts[block_id] += 1
        if high:
            self.high_refs[block_id] += 1
            self.num_high_blocks += self.high_refs[block_id] == 1

    def drop(self, block_id: int, high: bool) -> bool:
        """One reference fewer; True when the page became free."""
        assert self.ref_counts[block_id] > 0, f"releasing unowned page {block_id}"
        self.ref_counts[block_id] -= 1
        if high:
            self.high_refs[block_id] -= 1
            assert self.high_refs[block_id] >= 0, f"page {block_id} released by high more often than taken"
            self.num_high_blocks -= self.high_refs[block_id] == 0
        return self.is_free(block_id)

    def pin(self, block_id: int) -> bool:
        """One more pin; True when the page was free (it leaves its free queue)."""
        was_free = self.is_free(block_id)
        self.pins[block_id] += 1
        return was_free

    def unpin(self, block_id: int) -> bool:
        """One pin fewer; True when the page became free."""
        assert self.pins[block_id] > 0, f"unpinning page {block_id}, which is not pinned"
        self.pins[block_id] -= 1
        if self.pins[block_id]:
            return False
        del self.pins[block_id]
        return self.ref_counts[block_id] == 0

    def remap(self, remap: PageRemap) -> None:
        """Renames every page; the pages that hold nothing go first in line, the other uncached ones (kept
        by session pools) after them as before."""
        self.generation = list(remap.new_generation)
        self.ref_counts = remap.per_page(self.ref_counts)
        self.high_refs = remap.per_page(self.high_refs)
        uncached = remap.ids(self.uncached)
        first = set(remap.free)
        self.uncached = OrderedDict.fromkeys([*remap.free, *(b for b in uncached if b not in first)])
        assert len(self.uncached) == len(uncached), "a page holding nothing was not free"
        self.pins = Counter(remap.keys(self.pins))
