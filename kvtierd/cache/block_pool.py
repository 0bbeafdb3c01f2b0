"""Fixed-size KV pages with reference counts, free pages and a prefix index.

A page whose reference count drops to zero keeps its contents and its hash: it
is free to be reused, but until it is, a request with the same prefix can take
it back (`touch`). Allocation takes never-used pages first (no hash: nothing
is lost), then asks the eviction policy (`cache/eviction.py`) which idle cached
page goes, and forgets that page's hash then.

An idle cached page expires after `prefix_ttl_s` seconds without a use, or
once its hit rate has stayed under `prefix_min_hits_per_hour` for an hour
(0: never): a lookup that meets an expired page counts a miss and evicts it,
and `expire` sweeps a few between engine steps.

Invalidation (by namespace, tag, or a page and what was chained after it)
unindexes pages at once: no new request can find them. Pages in use keep their
contents for their holders and come back uncached when released. Unindexing a
page unindexes every page chained after it too: they would be unreachable.
Evictions are counted by reason.

Every page has a generation, bumped whenever its contents may change (it is
allocated, written in place, or unindexed): a session pool keeps pages it does
not hold by (page, generation) and uses them only while that still matches.

With lower tiers (`chunk_pages` > 0), a capacity eviction takes the evicted
page's whole chunk (the pages from the last multiple of `chunk_pages` in its
chain up to it; `tiers/chunk.py`): the chunk is logged in `evicted`, and its
other idle pages go too, so a chain is saved below once per chunk rather than
once per page as its tail shrinks. The pages keep their KV until someone
writes into them: the cache manager saves the log below before that
(`KVCacheManager.demote_evicted`).

QoS: pages held by high-class sequences are counted (`num_high_blocks`),
and a reserved region (`cache/reserved_region.py`) keeps the unused part of
the reserve out of reach of lower-class allocations.

Pins: a pinned page is never evicted, expired or handed out while pinned,
held or not: when idle it stays out of the free pages. Invalidation still
unindexes it (stale KV is never served); it stays pinned until unpinned.

Compaction (`cache/compaction.py`) renames pages by a permutation of their
ids (`renumber`) once their KV was copied the same way: every order the pool
keeps stays, and the pages that hold nothing go first in line for reuse.

Running out of pages is a normal outcome (`allocate` returns None and the
caller waits or preempts); a broken count is a bug and asserts.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.cache_shares import CacheShares, ShareEviction
from kvtierd.cache.eviction import EvictionCounts, IdlePage
from kvtierd.cache.reserved_region import ReservedRegion
from kvtierd.cache.retention import RetainedUntil, RetainingPolicy, Retention


HOUR_S = 3600.0


@dataclass(slots=True, frozen=True)
class CachedPage:
    """What the prefix index knows of one page."""

    block_hash: BlockHash
    root: BlockHash  # the namespace: model fingerprint + tenant (or the public namespace)
    tokens: tuple[int, ...]
    depth: int  # position in its chain: 0 for the first page
    parent_hash: BlockHash | None  # the previous page's hash; None at depth 0
    cached_at: float


@dataclass(slots=True, frozen=True)
class EvictedChunk:
    """Pages evicted for capacity, as the chunk the lower tiers store; their KV is intact until rewritten."""

    root: BlockHash
    first_depth: int  # a multiple of chunk_pages
    block_ids: tuple[int, ...]  # some may still be indexed (held by others, or shared by another chain)
    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[int, ...]
    hits: int  # the most any of its pages was hit


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
        if prefix_ttl_s < 0 or prefix_min_hits_per_hour < 0:
            raise ValueError("prefix_ttl_s and prefix_min_hits_per_hour must be 0 (off) or positive")
        self.num_blocks = num_blocks
        self.prefix_ttl_s = prefix_ttl_s
        self.prefix_min_hits_per_hour = prefix_min_hits_per_hour
        self._clock = clock
        self._ref_counts = [0] * num_blocks
        self.generation = [0] * num_blocks
        # Free pages: never-used ones (no hash) in their own queue, taken first;
        # idle cached ones in the policy, and in release order for expiry.
        self._uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Tenants' pages and counts; with shares on, eviction takes from the tenant furthest above its share.
        self.shares = shares if shares is not None else CacheShares(enabled=False)
        # Inside a tenant (or the pool), pages with a running retention hint go after the others.
        def retaining() -> RetainingPolicy:
            return RetainingPolicy(eviction_policy, clock)

        self._policy: ShareEviction | RetainingPolicy = ShareEviction(retaining, self.shares) \
            if self.shares.enabled else retaining()
        self.retained: dict[int, RetainedUntil] = {}  # page -> the retention hint it keeps, until it ends
        self._idle_cached: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._release_seq = 0
        self._rate_sweep: list[int] = []  # idle pages left to check against the hit-rate floor
        # Prefix index: hash -> page, what each cached page holds, and what was chained after it.
        self._by_hash: dict[BlockHash, int] = {}
        self._cached: dict[int, CachedPage] = {}
        self._children: dict[BlockHash, set[int]] = {}
        self.tags: dict[int, set[str]] = {}
        self._tagged: dict[str, set[int]] = {}
        self.hits: dict[int, int] = {}
        self.last_access: dict[int, float] = {}
        self.num_token_mismatches = 0
        self.evictions = EvictionCounts()
        self.chunk_pages = 0  # > 0 when lower tiers take evicted chunks
        self.evicted: list[EvictedChunk] = []  # capacity evictions not yet saved below
        self._high_refs = [0] * num_blocks  # references held by high-class sequences
        self.num_high_blocks = 0  # pages with at least one
        self.reserve: ReservedRegion | None = None  # None: no reserved region
        self._pins: Counter[int] = Counter()  # page -> pins holding it

    @property
    def eviction_policy(self) -> str:
        return self._policy.name

    @property
    def num_free_blocks(self) -> int:
        """Pages allocation may take: never used, or cached with no reference."""
        return len(self._uncached) + len(self._policy)

    @property
    def num_retained_blocks(self) -> int:
        """Idle cached pages whose retention hint still runs (they go after the others)."""
        return self._policy.num_retained

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pins)

    def is_pinned(self, block_id: int) -> bool:
        return block_id in self._pins

    def num_free_blocks_for(self, high: bool) -> int:
        """Free pages a class may take: lower classes leave the unused reserve alone."""
        if high or self.reserve is None:
            return self.num_free_blocks
        return max(0, self.num_free_blocks - self.reserve.unused(self.num_high_blocks))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def page_info(self, block_id: int) -> CachedPage | None:
        return self._cached.get(block_id)

    def block_of(self, block_hash: BlockHash) -> int | None:
        return self._by_hash.get(block_hash)

    def has_namespace(self, root: BlockHash) -> bool:
        return self.shares.cached[root] > 0

    def allocate(self, n: int, high: bool = False) -> list[int] | None:
        """Takes `n` free pages with ref count 1, or None if the class may take fewer (see the reserve)."""
        if n > self.num_free_blocks_for(high):
            return None
        blocks = []
        for _ in range(n):
            if self._uncached:
                b, _ = self._uncached.popitem(last=False)
            else:
                b = self._policy.pop()
                del self._idle_cached[b]
                root = self._cached[b].root
                counts = self.shares.counts_of(root)
                under = self.shares.is_under_share(root)
                n = self._evict_for_capacity(b)
                self.evictions.capacity += n
                counts.evictions += n
                counts.evictions_under_share += n if under else 0
            assert self._ref_counts[b] == 0, f"free page {b} still referenced"
            self._ref_counts[b] = 1
            self.generation[b] += 1
            if high:
                self._add_high(b)
            blocks.append(b)
        return blocks

    def note_write(self, block_id: int) -> None:
        """A holder writes into a page it already had: weak references to it go stale."""
        self.generation[block_id] += 1

    def share(self, block_ids: Sequence[int], high: bool = False) -> None:
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"sharing unowned page {b}"
            self._ref_counts[b] += 1
            if high:
                self._add_high(b)

    def touch(self, block_ids: Sequence[int], high: bool = False) -> None:
        """Takes a reference on cached (or weakly kept) pages, taking them out of the free pages if idle."""
        now = self._clock()
        for b in block_ids:
            if self._ref_counts[b] == 0:
                if b in self._idle_cached:
                    self._policy.discard(b)
                    del self._idle_cached[b]
                elif b not in self._pins:
                    del self._uncached[b]
            self._ref_counts[b] += 1
            if high:
                self._add_high(b)
            if b in self._cached:
                self.hits[b] = self.hits.get(b, 0) + 1
                self.shares.counts_of(self._cached[b].root).hits += 1
                self.last_access[b] = now

    def release(self, block_ids: Sequence[int], high: bool = False, retention: Retention | None = None) -> None:
        """Drops one reference from each page; pages reaching zero become free (unless pinned).

        Give a sequence's pages in order: they are released tail first, so the
        end of a chain is evicted before its shared beginning. `retention`: the
        indexed ones keep the hint (the strongest of the hints given) until it ends."""
        now = self._clock()
        if retention is not None:
            hint = RetainedUntil(retention.priority, now + retention.duration_s)
            for b in block_ids:
                if b in self._cached:
                    self.retained[b] = hint.merged(self.retained.get(b))
        for b in reversed(block_ids):
            assert self._ref_counts[b] > 0, f"releasing unowned page {b}"
            self._ref_counts[b] -= 1
            if high:
                self._high_refs[b] -= 1
                assert self._high_refs[b] >= 0, f"page {b} released by high more often than taken"
                self.num_high_blocks -= self._high_refs[b] == 0
            if self._ref_counts[b] == 0 and b not in self._pins:
                self._make_free(b, now)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Keeps pages as they are until unpinned: an idle one leaves the free pages."""
        for b in block_ids:
            if not self._pins[b] and self._ref_counts[b] == 0:
                if b in self._idle_cached:
                    self._policy.discard(b)
                    del self._idle_cached[b]
                else:
                    del self._uncached[b]
            self._pins[b] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        now = self._clock()
        for b in reversed(block_ids):  # tail first, as release does
            assert self._pins[b] > 0, f"unpinning page {b}, which is not pinned"
            self._pins[b] -= 1
            if not self._pins[b]:
                del self._pins[b]
                if self._ref_counts[b] == 0:
                    self._make_free(b, now)

    def _add_high(self, block_id: int) -> None:
        self._high_refs[block_id] += 1
        self.num_high_blocks += self._high_refs[block_id] == 1

    def _make_free(self, b: int, now: float) -> None:
        """A page nobody holds or pins: never-used again if uncached, else idle for the policy."""
        page = self._cached.get(b)
        if page is None:
            self._uncached[b] = None
            return
        self.last_access[b] = now
        self._release_seq += 1
        self._policy.add(IdlePage(b, page.block_hash, page.parent_hash, page.depth, self.hits.get(b, 0),
                                  self._release_seq, page.root, self.retained.get(b)))
        self._idle_cached[b] = None

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
        if block_hash in self._by_hash or block_id in self._cached:
            return
        assert depth == 0 or parent is not None, "a page after the first needs its parent's hash"
        if depth > 0 and parent not in self._by_hash:
            return  # its chain's head was dropped (invalidated): no lookup could reach it
        assert self._ref_counts[block_id] > 0, f"indexing page {block_id}, which nobody holds"
        now = self._clock()
        self._by_hash[block_hash] = block_id
        self._cached[block_id] = CachedPage(block_hash, root, tuple(tokens), depth, parent if depth > 0 else None, now)
        if depth > 0:
            self._children.setdefault(parent, set()).add(block_id)
        self.shares.add_page(root)
        self.last_access[block_id] = now

    def tag(self, block_ids: Sequence[int], tag: str) -> None:
        """Marks indexed pages as derived from `tag` (e.g. a document version)."""
        for b in block_ids:
            if b in self._cached:
                self.tags.setdefault(b, set()).add(tag)
                self._tagged.setdefault(tag, set()).add(b)

    def lookup(self, hashes: Sequence[BlockHash], token_chunks: Sequence[Sequence[int]]) -> list[int]:
        """Pages of the longest cached prefix of `hashes`, each confirmed by its tokens.

        An expired page ends the prefix and is evicted on the spot."""
        found = []
        now = self._clock()
        for h, tokens in zip(hashes, token_chunks):
            b = self._by_hash.get(h)
            if b is None:
                break
            if self._cached[b].tokens != tuple(tokens):
                self.num_token_mismatches += 1  # a collision or a planted value: never served
                break
            if self._is_expired(b, now):
                self.evictions.expired += self._unindex_tree(b)
                break
            found.append(b)
        return found

    def expire(self, now: float | None = None, max_pages: int = 64) -> int:
        """Evicts up to about `max_pages` expired idle cached pages; returns how many.

        Past the TTL: the oldest released first. Under the hit-rate floor: a
        bounded part of a sweep over the idle pages each call."""
        self._policy.decay()  # retention hints that ended: those pages are ordinary again
        if not (self.prefix_ttl_s or self.prefix_min_hits_per_hour):
            return 0
        now = self._clock() if now is None else now
        n = 0
        while self.prefix_ttl_s and n < max_pages and self._idle_cached:
            b = next(iter(self._idle_cached))
            if now - self.last_access[b] < self.prefix_ttl_s:
                break  # the rest were released later
            n += self._unindex_tree(b)
        if self.prefix_min_hits_per_hour:
            if not self._rate_sweep:
                self._rate_sweep = list(self._idle_cached)
            for _ in range(min(max_pages, len(self._rate_sweep))):
                b = self._rate_sweep.pop()
                if b in self._idle_cached and self._is_expired(b, now):
                    n += self._unindex_tree(b)
        self.evictions.expired += n
        return n

    def _is_expired(self, block_id: int, now: float) -> bool:
        if self._ref_counts[block_id] != 0 or block_id in self._pins:
            return False
        if self.prefix_ttl_s and now - self.last_access[block_id] >= self.prefix_ttl_s:
            return True
        age_h = (now - self._cached[block_id].cached_at) / HOUR_S
        # An hour's grace, so a new page can earn its first hits.
        return bool(self.prefix_min_hits_per_hour) and age_h >= 1.0 and \
            self.hits.get(block_id, 0) / age_h < self.prefix_min_hits_per_hour

    # -- invalidation ------------------------------------------------------------------

    def evict(self, block_id: int) -> bool:
        """Forgets an idle cached page now (and what was chained after it); it goes first in line for reuse."""
        if self._ref_counts[block_id] != 0 or block_id not in self._cached:
            return False
        self.evictions.invalidated += self._unindex_tree(block_id)
        return True

    def unindex_subtree(self, block_id: int) -> int:
        """Unindexes a page and every page chained after it; returns how many (the caller counts them)."""
        return self._unindex_tree(block_id) if block_id in self._cached else 0

    def unindex_from(self, block_id: int) -> int:
        """Unindexes a page, every page chained after it, and the pages before it
        that nothing else was chained after: a prefix and what was derived from it,
        sparing what other prefixes still share. Returns how many (the caller
        counts them under its reason)."""
        page = self._cached.get(block_id)
        if page is None:
            return 0
        n = self._unindex_tree(block_id)
        parent = page.parent_hash
        while parent is not None and parent not in self._children:
            b = self._by_hash.get(parent)
            if b is None:
                break
            parent = self._cached[b].parent_hash
            n += self._unindex_tree(b)
        return n

    def invalidate_namespace(self, root: BlockHash) -> int:
        """Drops every page of namespace `root` from the index; returns how many."""
        return self._invalidate([b for b, page in self._cached.items() if page.root == root])

    def invalidate_tag(self, tag: str) -> int:
        """Drops every page marked with `tag` and everything chained after them; returns how many."""
        return self._invalidate(list(self._tagged.get(tag, ())))

    def invalidate_all(self) -> int:
        return self._invalidate(list(self._cached))

    def _invalidate(self, block_ids: list[int]) -> int:
        n = sum(self._unindex_tree(b) for b in block_ids if b in self._cached)
        self.evictions.invalidated += n
        return n

    # -- compaction ---------------------------------------------------------------------

    def renumber(self, new_id: Sequence[int], free: Sequence[int]) -> None:
        """Renames each page b to new_id[b] (a permutation of every id) wherever the pool names it.

        `free` (new ids, ascending) are the pages that hold nothing: they go
        first in line for allocation, the other unreferenced uncached pages
        (kept by session pools) after them as before. A renamed page's
        generation moves past the old generations of both its ids, so every
        weak reference to either id goes stale: the caller renames those that
        were current."""
        assert not self.evicted, "evicted chunks are saved below before pages move"
        old_generation = self.generation
        self.generation = _permuted(old_generation, new_id)
        for b, new in enumerate(new_id):
            if new != b:
                self.generation[new] = max(old_generation[b], old_generation[new]) + 1
        self._ref_counts = _permuted(self._ref_counts, new_id)
        self._high_refs = _permuted(self._high_refs, new_id)
        uncached = [new_id[b] for b in self._uncached]
        first = set(free)
        self._uncached = OrderedDict.fromkeys([*free, *(b for b in uncached if b not in first)])
        assert len(self._uncached) == len(uncached), "a page holding nothing was not free"
        self._idle_cached = OrderedDict.fromkeys(new_id[b] for b in self._idle_cached)
        self._rate_sweep = [new_id[b] for b in self._rate_sweep]
        self._policy.renumber(new_id)
        self._by_hash = {h: new_id[b] for h, b in self._by_hash.items()}
        self._cached = {new_id[b]: page for b, page in self._cached.items()}
        self._children = {h: {new_id[b] for b in pages} for h, pages in self._children.items()}
        self.tags = {new_id[b]: tags for b, tags in self.tags.items()}
        self._tagged = {tag: {new_id[b] for b in pages} for tag, pages in self._tagged.items()}
        self.hits = {new_id[b]: n for b, n in self.hits.items()}
        self.retained = {new_id[b]: r for b, r in self.retained.items()}
        self.last_access = {new_id[b]: t for b, t in self.last_access.items()}
        self._pins = Counter({new_id[b]: n for b, n in self._pins.items()})

    # -- reports ------------------------------------------------------------------------

    def idle_cached_blocks(self) -> list[int]:
        """Cached pages nobody holds, least recently used first."""
        return list(self._idle_cached)

    def cached_blocks(self) -> list[tuple[int, CachedPage]]:
        """Every indexed page and what the index knows of it."""
        return list(self._cached.items())

    def is_leaf(self, block_id: int) -> bool:
        """An indexed page nothing of its namespace is chained after: the end of a
        cached prefix (a public prefix ends where tenants' own pages begin)."""
        page = self._cached.get(block_id)
        return page is not None and all(self._cached[c].root != page.root
                                        for c in self._children.get(page.block_hash, ()))

    def chain_to(self, block_id: int) -> list[int]:
        """The indexed pages from the start of `block_id`'s chain to it."""
        chain = [block_id]
        parent = self._cached[block_id].parent_hash
        while parent is not None:
            chain.append(self._by_hash[parent])  # an indexed page's parent is indexed
            parent = self._cached[chain[-1]].parent_hash
        return chain[::-1]

    def _evict_for_capacity(self, block_id: int) -> int:
        """Unindexes a page popped from the policy (and, with lower tiers, the idle rest of its chunk)."""
        if not self.chunk_pages:
            return self._unindex_tree(block_id)
        chunk = self._chunk_ending_at(block_id)
        n = self._unindex_tree(block_id)
        if chunk is None:
            return n
        self.evicted.append(chunk)
        for b in reversed(chunk.block_ids[:-1]):  # tail first, while nothing else needs them
            page = self._cached.get(b)
            if page is None or b not in self._idle_cached or page.block_hash in self._children:
                break
            n += self._unindex_tree(b)
        return n

    def chunks_next_in_line(self, max_pages: int) -> list[EvictedChunk]:
        """The chunks that capacity evictions would log next, up to `max_pages` pages: those ending at idle
        chain tails, least recently used first (the order of `lru`; the other policies' order differs)."""
        chunks: list[EvictedChunk] = []
        pages = 0
        if not self.chunk_pages:
            return chunks
        for tail in list(self._idle_cached):
            if pages >= max_pages:
                break
            b: int | None = tail if self.is_leaf(tail) else None
            while b is not None and pages < max_pages and (chunk := self._chunk_ending_at(b)) is not None:
                chunks.append(chunk)
                pages += len(chunk.block_ids)
                # Then the chunk before it, once this one is gone: an idle page with no other child.
                parent = self._cached[chunk.block_ids[0]].parent_hash
                b = self._by_hash.get(parent) if parent is not None else None
                if b is None or b not in self._idle_cached or len(self._children.get(parent, ())) > 1:
                    b = None
        return chunks

    def _chunk_ending_at(self, block_id: int) -> EvictedChunk | None:
        """The chunk whose last page is `block_id`; None if it spans two namespaces (a public prefix and a
        tenant's pages after it: not stored below in this version)."""
        page = self._cached[block_id]
        pages = [(block_id, page)]
        while page.depth % self.chunk_pages:
            b = self._by_hash[page.parent_hash]  # an indexed page's parent is indexed
            page = self._cached[b]
            pages.append((b, page))
        pages.reverse()
        if any(p.root != page.root for _, p in pages):
            return None
        return EvictedChunk(page.root, page.depth, tuple(b for b, _ in pages), tuple(p.block_hash for _, p in pages),
                            tuple(t for _, p in pages for t in p.tokens), max(self.hits.get(b, 0) for b, _ in pages))

    def _unindex_tree(self, block_id: int) -> int:
        """Unindexes a page and every indexed page chained after it; idle ones go
        first in line for reuse as never-used pages. Returns how many."""
        n = 0
        stack = [block_id]
        while stack:
            b = stack.pop()
            page = self._cached.pop(b)
            del self._by_hash[page.block_hash]
            stack.extend(self._children.pop(page.block_hash, ()))
            if page.parent_hash is not None:
                siblings = self._children.get(page.parent_hash)
                if siblings is not None:
                    siblings.discard(b)
                    if not siblings:
                        del self._children[page.parent_hash]
            self.shares.remove_page(page.root)
            for tag in self.tags.pop(b, ()):
                self._tagged[tag].discard(b)
                if not self._tagged[tag]:
                    del self._tagged[tag]
            self.hits.pop(b, None)
            self.retained.pop(b, None)
            self.last_access.pop(b, None)
            self.generation[b] += 1
            if b in self._idle_cached:
                self._policy.discard(b)
                del self._idle_cached[b]
                self._uncached[b] = None
                self._uncached.move_to_end(b, last=False)
            n += 1
        return n


def _permuted(values: list[int], new_id: Sequence[int]) -> list[int]:
    out = [0] * len(values)
    for b, value in enumerate(values):
        out[new_id[b]] = value
    return out
