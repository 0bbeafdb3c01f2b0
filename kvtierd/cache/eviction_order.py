"""The eviction order: idle cached pages (indexed, nobody holds or pins them), in the order they go.

The order is the configured policy (`cache/eviction.py`), inside each tenant
with cache shares on (`cache/cache_shares.py`), with retained pages after the
others (`cache/retention.py`). Beside it the idle pages are kept in release
order, oldest first, for the TTL sweep, and a sweep over them checks a
bounded part against the hit-rate floor each call. A page released with a
retention hint keeps it (the strongest of the hints given) until the hint
ends or the page is unindexed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtierd.cache.cache_shares import CacheShares, ShareEviction
from kvtierd.cache.eviction import IdlePage
from kvtierd.cache.page_remap import PageRemap
from kvtierd.cache.prefix_index import CachedPage
from kvtierd.cache.retention import RetainedUntil, RetainingPolicy


class EvictionOrder:
    def __init__(self, policy: str, shares: CacheShares, clock: Callable[[], float]) -> None:
        def retaining() -> RetainingPolicy:
            return RetainingPolicy(policy, clock)

        # With shares on, eviction takes from the tenant furthest above its share.
        self._policy: ShareEviction | RetainingPolicy = ShareEviction(retaining, shares) \
            if shares.enabled else retaining()
        self.retained: dict[int, RetainedUntil] = {}  # indexed page -> the retention hint it keeps, until it ends
        self.idle: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._release_seq = 0
        self._rate_sweep: list[int] = []  # idle pages left to check against the hit-rate floor

    @property
    def name(self) -> str:
        return self._policy.name

    @property
    def num_retained(self) -> int:
        """Idle pages whose retention hint still runs."""
        return self._policy.num_retained

    def __len__(self) -> int:
        return len(self.idle)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.idle

    def retain(self, block_id: int, hint: RetainedUntil) -> None:
        self.retained[block_id] = hint.merged(self.retained.get(block_id))

    def add(self, block_id: int, page: CachedPage, hits: int) -> None:
        """A cached page nobody holds any more: last in line."""
        self._release_seq += 1
        self._policy.add(IdlePage(block_id, page.block_hash, page.parent_hash, page.depth, hits, self._release_seq,
                                  page.root, self.retained.get(block_id)))
        self.idle[block_id] = None

    def discard(self, block_id: int) -> None:
        """An idle page taken back (adopted, pinned or unindexed)."""
        self._policy.discard(block_id)
        del self.idle[block_id]

    def pop(self) -> int:
        """The idle page to evict next (there must be one); it leaves the order."""
        b = self._policy.pop()
        del self.idle[b]
        return b

    def forget(self, block_id: int) -> None:
        """An unindexed page keeps no hint."""
        self.retained.pop(block_id, None)

    def decay(self) -> None:
        """Retention hints that ended: those pages are ordinary again."""
        self._policy.decay()

    def rate_sweep(self, max_pages: int) -> Iterator[int]:
        """The next pages of the sweep over the idle pages (some may have left meanwhile)."""
        if not self._rate_sweep:
            self._rate_sweep = list(self.idle)
        for _ in range(min(max_pages, len(self._rate_sweep))):
            yield self._rate_sweep.pop()

    def remap(self, remap: PageRemap) -> None:
        self._policy.remap(remap)
        self.retained = remap.keys(self.retained)
        self.idle = remap.order(self.idle)
        self._rate_sweep = remap.ids(self._rate_sweep)
