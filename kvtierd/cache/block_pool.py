"""Fixed-size KV pages: the block pool composes the per-page accounting, the prefix index and the eviction order.

    cache/page_refs.py        reference counts, pins, generations, never-used free pages (taken first)
    cache/prefix_index.py     hash -> page, chains, tags, expiry
    cache/eviction_order.py   idle cached pages, in the order they go (policy, shares, retention)
    cache/evicted_chunks.py   the chunks capacity evictions log for the lower tiers

A page whose reference count drops to zero keeps its contents and its hash: it
is free to be reused, but until it is, a request with the same prefix can take
it back (`touch`). Allocation takes never-used pages first (nothing is lost),
then the eviction order's next idle cached page, and forgets that page's hash
then (with lower tiers, the idle rest of its chunk too, logged in `evicted`
for the cache manager to save below before anything writes into them). A
lookup that meets an expired page counts a miss and evicts it; `expire`
sweeps a few between engine steps.

Invalidation (`cache/invalidation.py` chooses the pages) unindexes pages at
once, and every page chained after them (they would be unreachable): no new
request can find them; pages in use keep their
contents for their holders and come back uncached. Evictions are counted by
reason. A page's generation is bumped whenever its contents may change
(allocated, written in place, unindexed). Pages held by high-class sequences
are counted for the reserved region (`cache/reserved_region.py`). A pinned
page is never evicted, expired or handed out, held or not; invalidation still
unindexes it (stale KV is never served).

Compaction renames pages through one `PageRemap` (`cache/page_remap.py`) that
`remap` hands to each part. Running out of pages is a normal outcome
(`allocate` returns None and the caller waits or preempts); a broken count is
a bug and asserts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.evicted_chunks import EvictedChunk, chunk_ending_at, chunks_next_in_line
from kvtierd.cache.eviction import EvictionCounts
from kvtierd.cache.eviction_order import EvictionOrder
from kvtierd.cache.page_refs import PageRefs
from kvtierd.cache.page_remap import PageRemap
from kvtierd.cache.prefix_index import CachedPage, PrefixIndex
from kvtierd.cache.reserved_region import ReservedRegion
from kvtierd.cache.retention import RetainedUntil, Retention


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str = "lru",
        prefix_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        prefix_min_hits_per_hour: float = 0.0,
        shares: CacheShares | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one page; raise the KV budget")
        self.num_blocks = num_blocks
        self._clock = clock
        # Tenants' pages and counts; with shares on, eviction takes from the tenant furthest above its share.
        self.shares = shares if shares is not None else CacheShares(enabled=False)
        self.refs = PageRefs(num_blocks)
        self.index = PrefixIndex(self.shares, prefix_ttl_s, prefix_min_hits_per_hour, clock)
        self.order = EvictionOrder(eviction_policy, self.shares, clock)
        self.evictions = EvictionCounts()
        self.chunk_pages = 0  # > 0 when lower tiers take evicted chunks
        self.evicted: list[EvictedChunk] = []  # capacity evictions not yet saved below
        self.reserve: ReservedRegion | None = None  # None: no reserved region

    # What the other layers read, by the names they know.

    @property
    def eviction_policy(self) -> str:
        return self.order.name

    @property
    def generation(self) -> list[int]:
        return self.refs.generation

    @property
    def num_high_blocks(self) -> int:
        return self.refs.num_high_blocks

    @property
    def num_free_blocks(self) -> int:
        """Pages allocation may take: never used, or cached with no reference."""
        return len(self.refs.uncached) + len(self.order)

    @property
    def num_retained_blocks(self) -> int:
        """Idle cached pages whose retention hint still runs (they go after the others)."""
        return self.order.num_retained

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.refs.pins)

    def is_pinned(self, block_id: int) -> bool:
        return block_id in self.refs.pins

    def num_free_blocks_for(self, high: bool) -> int:
        """Free pages a class may take: lower classes leave the unused reserve alone."""
        if high or self.reserve is None:
            return self.num_free_blocks
        return max(0, self.num_free_blocks - self.reserve.unused(self.refs.num_high_blocks))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.index)

    def ref_count(self, block_id: int) -> int:
        return self.refs.ref_counts[block_id]

    def page_info(self, block_id: int) -> CachedPage | None:
        return self.index.pages.get(block_id)

    def block_of(self, block_hash: BlockHash) -> int | None:
        return self.index.by_hash.get(block_hash)

    def has_namespace(self, root: BlockHash) -> bool:
        return self.shares.cached[root] > 0

    # -- references ------------------------------------------------------------------------

    def allocate(self, n: int, high: bool = False) -> list[int] | None:
        """Takes `n` free pages with ref count 1, or None if the class may take fewer (see the reserve)."""
        if n > self.num_free_blocks_for(high):
            return None
        blocks = []
        for _ in range(n):
            b = self.refs.take_uncached()
            if b is None:
                b = self.order.pop()
                root = self.index.pages[b].root
                counts = self.shares.counts_of(root)
                under = self.shares.is_under_share(root)
                evicted = self._evict_for_capacity(b)
                self.evictions.capacity += evicted
                counts.evictions += evicted
                counts.evictions_under_share += evicted if under else 0
            assert self.refs.ref_counts[b] == 0, f"free page {b} still referenced"
            self.refs.hold(b, high)
            self.refs.generation[b] += 1
            blocks.append(b)
        return blocks

    def note_write(self, block_id: int) -> None:
        """A holder writes into a page it already had: weak references to it go stale."""
        self.refs.generation[block_id] += 1

    def share(self, block_ids: Sequence[int], high: bool = False) -> None:
        for b in block_ids:
            assert self.refs.ref_counts[b] > 0, f"sharing unowned page {b}"
            self.refs.hold(b, high)

    def touch(self, block_ids: Sequence[int], high: bool = False) -> None:
        """Takes a reference on cached (or weakly kept) pages, taking them out of the free pages if idle."""
        now = self._clock()
        for b in block_ids:
            if self.refs.is_free(b):
                self._leave_free(b)
            self.refs.hold(b, high)
            page = self.index.pages.get(b)
            if page is not None:
                self.index.hits[b] = self.index.hits.get(b, 0) + 1
                self.shares.counts_of(page.root).hits += 1
                self.index.last_access[b] = now

    def release(self, block_ids: Sequence[int], high: bool = False, retention: Retention | None = None) -> None:
        """Drops one reference from each page; pages reaching zero become free (unless pinned).

        Give a sequence's pages in order: they are released tail first, so the
        end of a chain is evicted before its shared beginning. `retention`: the
        indexed ones keep the hint (the strongest of the hints given) until it ends."""
        now = self._clock()
        if retention is not None:
            hint = RetainedUntil(retention.priority, now + retention.duration_s)
            for b in block_ids:
                if b in self.index:
                    self.order.retain(b, hint)
        for b in reversed(block_ids):
            if self.refs.drop(b, high):
                self._make_free(b, now)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Keeps pages as they are until unpinned: an idle one leaves the free pages."""
        for b in block_ids:
            if self.refs.pin(b):
                self._leave_free(b)

    def unpin(self, block_ids: Sequence[int]) -> None:
        now = self._clock()
        for b in reversed(block_ids):  # tail first, as release does
            if self.refs.unpin(b):
                self._make_free(b, now)

    def _leave_free(self, b: int) -> None:
        if b in self.order:
            self.order.discard(b)
        else:
            del self.refs.uncached[b]

    def _make_free(self, b: int, now: float) -> None:
        """A page nobody holds or pins: never-used again if uncached, else idle for the eviction order."""
        page = self.index.pages.get(b)
        if page is None:
            self.refs.put_uncached(b)
            return
        self.index.last_access[b] = now
        self.order.add(b, page, self.index.hits.get(b, 0))

    # -- the prefix index --------------------------------------------------------------------

    def cache(
        self,
        block_id: int,
        block_hash: BlockHash,
        tokens: Sequence[int],
        root: BlockHash,
        depth: int = 0,
        parent: BlockHash | None = None,
    ) -> None:
        """Indexes a full page in use under its hash (the first page with a hash keeps it).

        `depth` is its position in its chain and `parent` the previous page's
        hash (ignored at depth 0): the policies keep a chain's tail going first.
        A page whose parent is not indexed is not indexed either."""
        if block_hash not in self.index.by_hash and block_id not in self.index:
            assert self.refs.ref_counts[block_id] > 0, f"indexing page {block_id}, which nobody holds"
        self.index.add(block_id, block_hash, tokens, root, depth, parent)

    def tag(self, block_ids: Sequence[int], tag: str) -> None:
        """Marks indexed pages as derived from `tag` (e.g. a document version)."""
        self.index.tag(block_ids, tag)

    def lookup(self, hashes: Sequence[BlockHash], token_chunks: Sequence[Sequence[int]]) -> list[int]:
        """Pages of the longest cached prefix of `hashes`, each confirmed by its tokens.

        An expired page ends the prefix and is evicted on the spot."""
        found = []
        now = self._clock()
        for b in self.index.matching(hashes, token_chunks):
            if self._is_expired(b, now):
                self.evictions.expired += self._unindex_tree(b)
                break
            found.append(b)
        return found

    def expire(self, now: float | None = None, max_pages: int = 64) -> int:
        """Evicts up to about `max_pages` expired idle cached pages; returns how many.

        Past the TTL: the oldest released first. Under the hit-rate floor: a
        bounded part of a sweep over the idle pages each call."""
        self.order.decay()
        ttl_s, floor = self.index.ttl_s, self.index.min_hits_per_hour
        if not (ttl_s or floor):
            return 0
        now = self._clock() if now is None else now
        n = 0
        while ttl_s and n < max_pages and self.order.idle:
            b = next(iter(self.order.idle))
            if now - self.index.last_access[b] < ttl_s:
                break  # the rest were released later
            n += self._unindex_tree(b)
        if floor:
            for b in self.order.rate_sweep(max_pages):
                if b in self.order and self._is_expired(b, now):
                    n += self._unindex_tree(b)
        self.evictions.expired += n
        return n

    def _is_expired(self, block_id: int, now: float) -> bool:
        return self.refs.is_free(block_id) and self.index.is_expired(block_id, now)

    # -- unindexing ------------------------------------------------------------------

    def unindex_subtree(self, block_id: int) -> int:
        """Unindexes a page and every page chained after it; returns how many (the caller counts them under its
        reason: `cache/invalidation.py` chooses which pages go)."""
        return self._unindex_tree(block_id) if block_id in self.index else 0

    def _unindex_tree(self, block_id: int) -> int:
        """Unindexes a page and every indexed page chained after it; idle ones go
        first in line for reuse as never-used pages. Returns how many."""
        gone = self.index.unindex_tree(block_id)
        for b in gone:
            self.order.forget(b)
            self.refs.generation[b] += 1
            if b in self.order:
                self.order.discard(b)
                self.refs.put_uncached(b, first=True)
        return len(gone)

    # -- capacity evictions for the lower tiers ---------------------------------------------

    def _evict_for_capacity(self, block_id: int) -> int:
        """Unindexes a page popped from the eviction order (and, with lower tiers, the idle rest of its chunk)."""
        if not self.chunk_pages:
            return self._unindex_tree(block_id)
        chunk = chunk_ending_at(self.index, block_id, self.chunk_pages)
        n = self._unindex_tree(block_id)
        if chunk is None:
            return n
        self.evicted.append(chunk)
        for b in reversed(chunk.block_ids[:-1]):  # tail first, while nothing else needs them
            page = self.index.pages.get(b)
            if page is None or b not in self.order or page.block_hash in self.index.children:
                break
            n += self._unindex_tree(b)
        return n

    def chunks_next_in_line(self, max_pages: int) -> list[EvictedChunk]:
        """The chunks that capacity evictions would log next, up to `max_pages` pages (`lru`'s order;
        the other policies' order differs)."""
        return chunks_next_in_line(self.index, self.order.idle, self.chunk_pages, max_pages)

    # -- reports and compaction ----------------------------------------------------------------

    def idle_cached_blocks(self) -> list[int]:
        """Cached pages nobody holds, least recently used first."""
        return list(self.order.idle)

    def cached_blocks(self) -> list[tuple[int, CachedPage]]:
        """Every indexed page and what the index knows of it."""
        return list(self.index.pages.items())

    def remap(self, remap: PageRemap) -> None:
        """Renames every page as compaction says, in each part."""
        assert not self.evicted, "evicted chunks are saved below before pages move"
        for part in (self.refs, self.index, self.order):
            part.remap(remap)
