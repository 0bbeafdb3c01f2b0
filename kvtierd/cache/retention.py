"""Soft retention: a hint that keeps a request's cached pages ahead of ordinary ones in eviction, for a while.

A request (a session's turn, or any prompt) may carry `retention`: a priority (1-10) and a duration. When
it finishes, its indexed pages remember the hint until `until = release time + duration`; a page touched
again by another retaining request keeps the higher priority and the later end.

    idle pages of a tenant:   ordinary ones (the policy's order) | retained ones, lowest priority, then
                              soonest to end, first
    after `until`:            the page decays into the ordinary ones, in its original release order

Retained pages are evicted only when the tenant (with cache shares; else the pool) has no ordinary idle
page left; they still count toward the tenant's share, so a tenant cannot retain its way past its share.
A pin is the hard guarantee: a pinned page is never evicted, expired or handed out. Retention is soft: a
retained page goes when nothing else can, it expires by `prefix_ttl_s` like any page, and it lasts at
most a day (MAX_RETENTION_S).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvtierd.cache.eviction import EvictionPolicy, IdlePage, make_policy
from kvtierd.cache.page_remap import PageRemap

MAX_RETENTION_PRIORITY = 10
MAX_RETENTION_S = 86400.0  # a day: longer wants a pin, which an admin sets and can see


@dataclass(frozen=True, slots=True)
class Retention:
    """A request's hint: how much to keep its pages (1 least, 10 most), and for how long."""

    priority: int
    duration_s: float

    def __post_init__(self) -> None:
        if not 1 <= self.priority <= MAX_RETENTION_PRIORITY or not self.duration_s > 0:
            raise ValueError(f"retention needs a priority in [1, {MAX_RETENTION_PRIORITY}] and a duration > 0")


@dataclass(frozen=True, slots=True)
class RetainedUntil:
    """What a page remembers of the hints of the requests that released it."""

    priority: int
    until: float  # clock time the hint ends

    def merged(self, other: RetainedUntil | None) -> RetainedUntil:
        if other is None:
            return self
        return RetainedUntil(max(self.priority, other.priority), max(self.until, other.until))


class RetainingPolicy(EvictionPolicy):
    """A policy for ordinary idle pages, and retained ones after them until their hint ends."""

    def __init__(self, policy: str, clock: Callable[[], float]) -> None:
        super().__init__()
        self._ordinary = make_policy(policy)
        self.name = self._ordinary.name
        self._clock = clock
        self._retained: dict[int, IdlePage] = {}
        self._by_rank: list[tuple[int, float, int, int]] = []  # (priority, until, entry, page): least kept first
        self._by_end: list[tuple[float, int, int]] = []  # (until, entry, page): the next to decay first
        self._entry_of: dict[int, int] = {}
        self._entries = itertools.count()

    def _added(self, page: IdlePage) -> None:
        held = page.retained
        page = page.copy()
        if held is None or held.until <= self._clock():
            self._ordinary.add(page)
            return
        entry = next(self._entries)
        self._retained[page.block_id] = page
        self._entry_of[page.block_id] = entry
        heapq.heappush(self._by_rank, (held.priority, held.until, entry, page.block_id))
        heapq.heappush(self._by_end, (held.until, entry, page.block_id))

    def _removed(self, page: IdlePage) -> None:
        if self._retained.pop(page.block_id, None) is not None:
            del self._entry_of[page.block_id]  # its heap entries go stale
        else:
            self._ordinary.discard(page.block_id)

    def _choose(self) -> int:
        self.decay()
        if len(self._ordinary):
            return self._ordinary._choose()  # `pop` discards it at once
        while True:
            _, _, entry, b = heapq.heappop(self._by_rank)
            if self._entry_of.get(b) == entry:
                return b

    def decay(self) -> int:
        """Moves the pages whose hint ended among the ordinary ones; returns how many."""
        now, n = self._clock(), 0
        while self._by_end and self._by_end[0][0] <= now:
            _, entry, b = heapq.heappop(self._by_end)
            if self._entry_of.get(b) == entry:
                page = self._retained.pop(b)
                del self._entry_of[b]
                self._ordinary.add(page)
                n += 1
        return n

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def _remapped(self, remap: PageRemap) -> None:
        self._ordinary.remap(remap)
        self._retained = remap.keys(self._retained)
        for page in self._retained.values():
            page.block_id = remap[page.block_id]
        self._entry_of = remap.keys(self._entry_of)
        self._by_rank = [(p, u, e, remap[b]) for p, u, e, b in self._by_rank]
        self._by_end = [(u, e, remap[b]) for u, e, b in self._by_end]
