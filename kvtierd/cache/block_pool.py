"""Fixed-size KV pages with reference counts, free pages and a prefix index.

A page whose reference count drops to zero keeps its contents and its hash: it
is free to be reused, but until it is, a request with the same prefix can take
it back (`touch`). Allocation takes never-used pages first (no hash: nothing
is lost), then asks the eviction policy (`cache/eviction.py`) which idle cached
page goes, and forgets that page's hash then.

An idle cached page expires after `prefix_ttl_s` seconds without a use (0:
never): a lookup that meets it counts a miss and evicts it, and `expire`
sweeps the oldest few between engine steps. `invalidate_namespace` drops a
namespace's pages on request; pages in use keep their contents for their
holders and come back uncached when released. Evictions are counted by reason.

Running out of pages is a normal outcome (`allocate` returns None and the
caller waits or preempts); a broken count is a bug and asserts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.eviction import EvictionCounts, EvictionPolicy, IdlePage, make_policy


@dataclass(slots=True, frozen=True)
class CachedPage:
    """What the prefix index knows of one page."""

    block_hash: BlockHash
    root: BlockHash  # the namespace: model fingerprint + tenant
    tokens: tuple[int, ...]
    depth: int  # position in its chain: 0 for the first page
    parent_hash: BlockHash | None  # the previous page's hash; None at depth 0


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str = "lru",
        prefix_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one page; raise the KV budget")
        if prefix_ttl_s < 0:
            raise ValueError("prefix_ttl_s must be 0 (never expire) or positive")
        self.num_blocks = num_blocks
        self.prefix_ttl_s = prefix_ttl_s
        self._clock = clock
        self._ref_counts = [0] * num_blocks
        # Free pages: never-used ones (no hash) in their own queue, taken first;
        # idle cached ones in the policy, and in release order for expiry.
        self._uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._policy: EvictionPolicy = make_policy(eviction_policy)
        self._idle_cached: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._release_seq = 0
        # Prefix index: hash -> page, and what each cached page holds.
        self._by_hash: dict[BlockHash, int] = {}
        self._cached: dict[int, CachedPage] = {}
        self.hits: dict[int, int] = {}
        self.last_access: dict[int, float] = {}
        self.num_token_mismatches = 0
        self.evictions = EvictionCounts()

    @property
    def eviction_policy(self) -> str:
        return self._policy.name

    @property
    def num_free_blocks(self) -> int:
        """Pages allocation may take: never used, or cached with no reference."""
        return len(self._uncached) + len(self._policy)

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

    def allocate(self, n: int) -> list[int] | None:
        """Takes `n` free pages with ref count 1, or None if there are fewer free."""
        if n > self.num_free_blocks:
            return None
        blocks = []
        for _ in range(n):
            if self._uncached:
                b, _ = self._uncached.popitem(last=False)
            else:
                b = self._policy.pop()
                del self._idle_cached[b]
                self._forget(b)
                self.evictions.capacity += 1
            assert self._ref_counts[b] == 0, f"free page {b} still referenced"
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"sharing unowned page {b}"
            self._ref_counts[b] += 1

    def touch(self, block_ids: Sequence[int]) -> None:
        """Takes a reference on cached pages, taking them out of the free pages if idle."""
        now = self._clock()
        for b in block_ids:
            if self._ref_counts[b] == 0:
                if b in self._idle_cached:
                    self._policy.discard(b)
                    del self._idle_cached[b]
                else:
                    del self._uncached[b]
            self._ref_counts[b] += 1
            if b in self._cached:
                self.hits[b] = self.hits.get(b, 0) + 1
                self.last_access[b] = now

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops one reference from each page; pages reaching zero become free.

        Give a sequence's pages in order: they are released tail first, so the
        end of a chain is evicted before its shared beginning."""
        now = self._clock()
        for b in reversed(block_ids):
            assert self._ref_counts[b] > 0, f"releasing unowned page {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] != 0:
                continue
            page = self._cached.get(b)
            if page is None:
                self._uncached[b] = None
                continue
            self.last_access[b] = now
            self._release_seq += 1
            self._policy.add(IdlePage(b, page.block_hash, page.parent_hash, page.depth, self.hits.get(b, 0),
                                      self._release_seq))
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
        self._by_hash[block_hash] = block_id
        self._cached[block_id] = CachedPage(block_hash, root, tuple(tokens), depth, parent if depth > 0 else None)
        self.last_access[block_id] = self._clock()

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
                self._expire_chain(hashes[len(found):], now)
                break
            found.append(b)
        return found

    def expire(self, now: float | None = None, max_pages: int = 64) -> int:
        """Evicts up to `max_pages` idle cached pages unused for `prefix_ttl_s`, oldest first; returns how many."""
        if not self.prefix_ttl_s:
            return 0
        now = self._clock() if now is None else now
        n = 0
        while n < max_pages and self._idle_cached:
            b = next(iter(self._idle_cached))
            if not self._is_expired(b, now):
                break  # the rest were released later
            self._drop(b)
            n += 1
        self.evictions.expired += n
        return n

    def evict(self, block_id: int) -> bool:
        """Forgets an idle cached page now and puts it first in line for reuse."""
        if self._ref_counts[block_id] != 0 or block_id not in self._cached:
            return False
        self._drop(block_id)
        self.evictions.invalidated += 1
        return True

    def invalidate_namespace(self, root: BlockHash) -> int:
        """Drops every page of namespace `root` from the index; returns how many.

        Idle ones become never-used pages now; pages in use stay with their
        holders and come back uncached when released."""
        pages = [b for b, page in self._cached.items() if page.root == root]
        for b in pages:
            self._drop(b)
        self.evictions.invalidated += len(pages)
        return len(pages)

    def idle_cached_blocks(self) -> list[int]:
        """Cached pages nobody holds, least recently used first."""
        return list(self._idle_cached)

    def cached_blocks(self) -> list[tuple[int, BlockHash, BlockHash, tuple[int, ...]]]:
        """(page, hash, namespace root, tokens) of every indexed page."""
        return [(b, p.block_hash, p.root, p.tokens) for b, p in self._cached.items()]

    def _expire_chain(self, hashes: Sequence[BlockHash], now: float) -> None:
        """Evicts the expired run of a chain that a lookup met: unreachable now anyway."""
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None or not self._is_expired(b, now):
                return
            self._drop(b)
            self.evictions.expired += 1

    def _is_expired(self, block_id: int, now: float) -> bool:
        return (self.prefix_ttl_s > 0 and self._ref_counts[block_id] == 0
                and now - self.last_access[block_id] >= self.prefix_ttl_s)

    def _drop(self, block_id: int) -> None:
        """Unindexes a cached page; an idle one goes first in line for reuse."""
        if self._ref_counts[block_id] == 0:
            self._policy.discard(block_id)
            del self._idle_cached[block_id]
            self._uncached[block_id] = None
            self._uncached.move_to_end(block_id, last=False)
        self._forget(block_id)

    def _forget(self, block_id: int) -> None:
        page = self._cached.pop(block_id, None)
        if page is not None:
            del self._by_hash[page.block_hash]
        self.hits.pop(block_id, None)
        self.last_access.pop(block_id, None)
