"""Invalidation: cached KV dropped on request, on the device and below.

By prefix (its full pages and what was chained after them, sparing pages
other prefixes share), page hash, session, namespace (a tenant's cache
flushed), tag, or all of it. Sequences holding dropped pages keep reading
them; those pages come back uncached. The lower tiers know no namespaces or
tags: a session's chunks go by their keys, any other invalidation empties
them all (a new tier epoch). `count` counts invalidations: a load begun
before one indexes nothing (it may be what was invalidated).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.cache.block_hash import BlockHash, BlockHashes
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.prefix_lookup import PrefixLookup
from kvtierd.cache.session_cache import SessionCache
from kvtierd.cache.session_pool import SessionKey
from kvtierd.tiers.tier_manager import TierManager


class Invalidation:
    def __init__(self, pool: BlockPool, sessions: SessionCache, lookup: PrefixLookup,
                 tiers: TierManager | None) -> None:
        self.pool = pool
        self._sessions = sessions
        self._lookup = lookup
        self._tiers = tiers
        self.count = 0

    def prefix(self, hashes: BlockHashes, token_ids: Sequence[int]) -> int:
        """Unindexes the cached pages of `token_ids` (full pages) and what was chained after them,
        sparing pages other prefixes share; returns how many."""
        blocks = self._lookup.pages(hashes.of_full_pages(token_ids), token_ids)
        return self._unindex_from(blocks[-1] if blocks else None)

    def hash(self, block_hash: BlockHash) -> int:
        return self._unindex_from(self.pool.block_of(block_hash))

    def drop_session(self, key: SessionKey) -> int:
        """Forgets a session's pool and unindexes the pages it computed itself (not those it adopted from
        the prefix index) and what was chained after them; its chunks below go by key. Returns how many."""
        chain = self._sessions.sessions.forget(key)
        if chain is None:
            return 0
        self.count += 1
        if self._tiers is not None:
            self._tiers.forget(chain.block_hashes[chain.own_from :])
        return self._sessions.drop(chain)

    def session(self, key: SessionKey) -> int:
        n = self.drop_session(key)
        self.pool.evictions.invalidated += n
        return n

    def namespace(self, root: BlockHash) -> int:
        """Drops every cached page and session pool of a namespace (a tenant's cache flushed); returns pages."""
        self._sessions.sessions.forget_namespace(root)
        self._below()
        return self._drop([b for b, page in self.pool.index.pages.items() if page.root == root])

    def tag(self, tag: str) -> int:
        """Drops every page marked with `tag` and everything chained after them; returns how many."""
        self._below()
        return self._drop(list(self.pool.index.tagged.get(tag, ())))

    def all(self) -> int:
        self._sessions.sessions.forget_all()
        self._below()
        return self._drop(list(self.pool.index.pages))

    def _unindex_from(self, block_id: int | None) -> int:
        """Unindexes a page, every page chained after it, and the pages before it that nothing else was chained
        after: a prefix and what was derived from it, sparing what other prefixes still share."""
        index = self.pool.index
        page = index.pages.get(block_id) if block_id is not None else None
        n = self.pool.unindex_subtree(block_id) if page is not None else 0
        parent = page.parent_hash if page is not None else None
        while parent is not None and parent not in index.children and (b := index.by_hash.get(parent)) is not None:
            parent = index.pages[b].parent_hash
            n += self.pool.unindex_subtree(b)
        self.pool.evictions.invalidated += n
        self._below()
        return n

    def _drop(self, block_ids: list[int]) -> int:
        n = sum(self.pool.unindex_subtree(b) for b in block_ids)
        self.pool.evictions.invalidated += n
        return n

    def _below(self) -> None:
        # The lower tiers know no namespaces or tags: all they hold goes (a session's chunks go by key).
        self.count += 1
        if self._tiers is not None:
            self._tiers.invalidate_all()
