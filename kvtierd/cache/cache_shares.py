"""Cache shares: each tenant is entitled to its weighted share of the cached pages, and eviction takes
first from the tenant furthest above its share.

    standing(t) = cached(t) / weight(t)     cached: the tenant's indexed device pages, held or idle
    share(t)    = all cached * weight(t) / (sum of the weights of the tenants with cached pages)

When a page must go, it comes from the tenant with the highest standing among those with an idle cached
page; inside that tenant, the configured policy and its tail-first order choose (`cache/eviction.py`).
A tenant above its share has a standing above the average, so while any tenant above its share has an
idle page, no tenant under its share loses one: a tenant's burst of unique prompts evicts its own pages.
Pages a request holds count toward its tenant's standing, so a tenant whose running requests fill the
pool gives up its idle pages before a quiet tenant does. Pinned pages count too (they are the tenant's)
but are never evicted; the reserved region keeps its own rule (a lower class cannot take the unused reserve).

A tenant is a namespace root here (model fingerprint + tenant salt); the public namespace is one more
tenant, named "public". Weights are by tenant name (`[qos] tenant_cache_weights`); a tenant not named
weighs 1. With shares off, one policy orders every tenant's pages as before; the counts are kept either way.
The arithmetic lives in `storage/owner_shares.py`: the host slab and the disk store share by it too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.eviction import EvictionPolicy, IdlePage
from kvtierd.cache.page_remap import PageRemap
from kvtierd.cache.retention import RetainingPolicy
from kvtierd.storage.owner_shares import WeightedShares


@dataclass(slots=True)
class TenantCacheCounts:
    """One tenant's device pages: adopted from the cache, evicted for capacity, and evicted while under
    its share (only when no tenant above its share had an idle page; with shares off, whenever LRU said so)."""

    hits: int = 0
    evictions: int = 0
    evictions_under_share: int = 0


class CacheShares:
    """Tenant weights by namespace root, each tenant's cached pages, and the counts the admin routes show."""

    def __init__(self, weights: Mapping[str, float] | None = None, enabled: bool = True) -> None:
        weights = dict(weights or {})
        if any(not w > 0 for w in weights.values()):
            raise ValueError("tenant cache weights must be positive")
        self.enabled = enabled
        self.tenant_weights = weights
        self.names: dict[BlockHash, str] = {}  # root -> tenant name, as the engine registered it
        self.pages: WeightedShares[BlockHash] = WeightedShares(self.weight)  # indexed device pages per root
        self.counts: dict[BlockHash, TenantCacheCounts] = {}

    def name(self, root: BlockHash, tenant: str) -> None:
        self.names.setdefault(root, tenant)

    def weight(self, root: BlockHash) -> float:
        return self.tenant_weights.get(self.names.get(root, ""), 1.0)

    @property
    def cached(self) -> Counter[BlockHash]:
        return self.pages.held

    def standing(self, root: BlockHash) -> float:
        return self.pages.standing(root)

    def share_pages(self, root: BlockHash) -> float:
        """The cached pages this tenant is entitled to now."""
        return self.pages.share(root)

    def is_under_share(self, root: BlockHash) -> bool:
        return self.pages.is_under_share(root)

    def add_page(self, root: BlockHash) -> None:
        self.pages.add(root)

    def remove_page(self, root: BlockHash) -> None:
        self.pages.remove(root)

    def counts_of(self, root: BlockHash) -> TenantCacheCounts:
        counts = self.counts.get(root)
        if counts is None:
            counts = self.counts[root] = TenantCacheCounts()
        return counts

    @property
    def num_evictions_under_share(self) -> int:
        return sum(c.evictions_under_share for c in self.counts.values())


class ShareEviction(EvictionPolicy):
    """One policy per tenant; `pop` takes from the tenant with the highest standing that has an idle page."""

    def __init__(self, make_policy: Callable[[], RetainingPolicy], shares: CacheShares) -> None:
        super().__init__()
        self.name = make_policy().name  # an unknown name fails here
        self._make_policy = make_policy
        self._shares = shares
        self._by_root: dict[BlockHash, RetainingPolicy] = {}

    def _added(self, page: IdlePage) -> None:
        sub = self._by_root.get(page.root)
        if sub is None:
            sub = self._by_root[page.root] = self._make_policy()
        sub.add(page.copy())

    def _removed(self, page: IdlePage) -> None:
        sub = self._by_root[page.root]
        sub.discard(page.block_id)
        if not len(sub):
            del self._by_root[page.root]

    def _choose(self) -> int:
        # Ties go to the tenant with more idle pages, then to the first seen: the choice is deterministic.
        root = max(self._by_root, key=lambda r: (self._shares.standing(r), len(self._by_root[r])))
        return self._by_root[root]._choose()  # `pop` discards it from that policy at once

    def decay(self) -> int:
        return sum(sub.decay() for sub in self._by_root.values())

    @property
    def num_retained(self) -> int:
        return sum(sub.num_retained for sub in self._by_root.values())

    def _remapped(self, remap: PageRemap) -> None:
        for sub in self._by_root.values():
            sub.remap(remap)
