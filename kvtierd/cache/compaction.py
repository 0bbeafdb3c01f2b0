"""Compaction: live pages renumbered to sit together, each sequence's in order, the free pages one run above.

    page     0 1 2 3 4 5 6 7 8 9              0 1 2 3 4 5 6 7 8 9
    before   A A . B . . A B . .     after    A A A B B . . . . .

Live pages take the lowest ids depth first over one forest. Every sequence
(a running sequence's page table, a session pool's resident head) and every
indexed page with the page it is chained after give links; a page's first
predecessor is its parent. A page's first child takes the next id, so each
chain runs consecutively up to a branch, and a branch starts after the whole
subtree before it. Among roots and among siblings, pages of sequences go
first (a running turn is copied below when it finishes), then lower ids, so
a compacted pool plans no moves. Live pages in no link (a chain of one page,
a pin left out of every chain) come last, by id.

A live page held by something that is not a page table (a load in flight)
is fixed: it keeps its id and the others are placed around it.

The plan is a permutation of all page ids: live pages go to their places, and
the free pages they land on take the places they left. So every holder of
page ids (the block pool's parts, page tables, session pools, pins) is
renamed by one `PageRemap` (`cache/page_remap.py`) and every order they keep
(free queue, eviction order) stays as it was. Only live pages
that move are copied; `DeviceKVPool.copy_blocks` reads every source page of a
layer before it writes any, so moves may chain and cycle. A plan is valid
only until the pages change: copy and rename between two engine steps
(`KVCacheManager.plan_compaction` / `apply_compaction`).

A page's generation steps past the old generations of both its ids
(`PageRemap.of`): a session pool's reference to a page that still held its
KV follows the page, and a stale one stays stale.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.cache.fragmentation import Fragmentation, PageUse, measure
from kvtierd.cache.page_remap import PageRemap


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    new_id: list[int]  # page b becomes page new_id[b]: a permutation of every page id
    copies: list[tuple[int, int]]  # (old, new) of the live pages that move: copy their KV, then rename
    free: list[int]  # the free pages afterwards (new ids, ascending): allocation takes them first
    before: Fragmentation

    def remap(self, generation: list[int]) -> PageRemap:
        """The renaming every holder applies, from the block pool's generations now."""
        return PageRemap.of(self.new_id, self.free, generation)


@dataclass(frozen=True, slots=True)
class CompactionResult:
    pages_moved: int
    before: Fragmentation
    after: Fragmentation
    seconds: float


def plan_compaction(use: PageUse) -> CompactionPlan:
    order = _placement_order(use)
    places = [b for b in range(use.num_blocks) if b not in use.fixed][: len(order)]
    new_id = list(range(use.num_blocks))
    for b, place in zip(order, places):
        new_id[b] = place
    taken = set(places)
    displaced = [p for p in places if p not in use.live]  # free pages a live page lands on
    vacated = sorted(b for b in order if b not in taken)  # live pages' old places, free afterwards
    for p, b in zip(displaced, vacated, strict=True):
        new_id[p] = b
    copies = [(b, new_id[b]) for b in order if new_id[b] != b]
    free = [b for b in range(use.num_blocks) if b not in taken and b not in use.fixed]
    return CompactionPlan(new_id, copies, free, measure(use))


def _placement_order(use: PageUse) -> list[int]:
    """Live pages that may move, in the order they take the lowest ids (see the module's docstring)."""
    parent: dict[int, int] = {}
    links = [(a, b) for seq in use.sequences for a, b in zip(seq, seq[1:])] + use.index_links
    for a, b in links:
        parent.setdefault(b, a)
    children: dict[int, list[int]] = {}
    for b, a in parent.items():
        children.setdefault(a, []).append(b)
    in_sequence = {b for seq in use.sequences for b in seq}

    def key(b: int) -> tuple[bool, int]:
        return b not in in_sequence, b

    movable = use.live - use.fixed
    order: list[int] = []
    roots = [b for seq in use.sequences for b in seq[:1]] + [a for a, _ in use.index_links]
    stack = sorted({b for b in roots if b not in parent}, key=key, reverse=True)
    while stack:  # one parent per page: each is visited once
        b = stack.pop()
        if b in movable:
            order.append(b)
        stack.extend(sorted(children.get(b, ()), key=key, reverse=True))
    return order + sorted(movable.difference(order))
