"""The prefix index: hash -> page, what each indexed page holds, its chain, namespace and tags, and its expiry.

    hash h_i --> page b --> CachedPage(h_i, root, tokens, depth i, parent h_{i-1})
    parent h_{i-1} --> {pages chained after it}          tag --> {pages derived from it}

A lookup walks a prompt's chained hashes (`cache/block_hash.py`) and stops at
the first page missing or whose stored tokens differ (a collision or a
planted value: never served). A page is indexed only after its parent, and
unindexing a page unindexes every page chained after it (they would be
unreachable): `unindex_tree` returns them all, for the block pool to free.

An idle indexed page expires after `ttl_s` seconds without a use, or once its
hit rate has stayed under `min_hits_per_hour` for an hour (0: never).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.page_remap import PageRemap

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


class PrefixIndex:
    def __init__(self, shares: CacheShares, ttl_s: float = 0.0, min_hits_per_hour: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0 or min_hits_per_hour < 0:
            raise ValueError("prefix_ttl_s and prefix_min_hits_per_hour must be 0 (off) or positive")
        self.shares = shares  # counts each namespace's indexed pages
        self.ttl_s = ttl_s
        self.min_hits_per_hour = min_hits_per_hour
        self._clock = clock
        self.by_hash: dict[BlockHash, int] = {}
        self.pages: dict[int, CachedPage] = {}
        self.children: dict[BlockHash, set[int]] = {}
        self.tags: dict[int, set[str]] = {}
        self.tagged: dict[str, set[int]] = {}
        self.hits: dict[int, int] = {}
        self.last_access: dict[int, float] = {}
        self.num_token_mismatches = 0

    def __len__(self) -> int:
        return len(self.pages)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.pages

    def add(self, block_id: int, block_hash: BlockHash, tokens: Sequence[int], root: BlockHash, depth: int,
            parent: BlockHash | None) -> bool:
        """Indexes a page under its hash; False when the hash or page is indexed already, or its parent is not."""
        if block_hash in self.by_hash or block_id in self.pages:
            return False
        assert depth == 0 or parent is not None, "a page after the first needs its parent's hash"
        if depth > 0 and parent not in self.by_hash:
            return False  # its chain's head was dropped (invalidated): no lookup could reach it
        now = self._clock()
        self.by_hash[block_hash] = block_id
        self.pages[block_id] = CachedPage(block_hash, root, tuple(tokens), depth, parent if depth > 0 else None, now)
        if depth > 0:
            self.children.setdefault(parent, set()).add(block_id)
        self.shares.add_page(root)
        self.last_access[block_id] = now
        return True

    def tag(self, block_ids: Sequence[int], tag: str) -> None:
        for b in block_ids:
            if b in self.pages:
                self.tags.setdefault(b, set()).add(tag)
                self.tagged.setdefault(tag, set()).add(b)

    def matching(self, hashes: Sequence[BlockHash], token_chunks: Sequence[Sequence[int]]) -> Iterator[int]:
        """The pages of `hashes` in order, each confirmed by its tokens, up to the first that is not."""
        for h, tokens in zip(hashes, token_chunks):
            b = self.by_hash.get(h)
            if b is None:
                return
            if self.pages[b].tokens != tuple(tokens):
                self.num_token_mismatches += 1
                return
            yield b

    def is_expired(self, block_id: int, now: float) -> bool:
        """Past the TTL since its last use, or under the hit-rate floor (for an idle page: the caller asks)."""
        if self.ttl_s and now - self.last_access[block_id] >= self.ttl_s:
            return True
        age_h = (now - self.pages[block_id].cached_at) / HOUR_S
        # An hour's grace, so a new page can earn its first hits.
        return bool(self.min_hits_per_hour) and age_h >= 1.0 and \
            self.hits.get(block_id, 0) / age_h < self.min_hits_per_hour

    def is_leaf(self, block_id: int) -> bool:
        """An indexed page nothing of its namespace is chained after: the end of a
        cached prefix (a public prefix ends where tenants' own pages begin)."""
        page = self.pages.get(block_id)
        return page is not None and all(self.pages[c].root != page.root
                                        for c in self.children.get(page.block_hash, ()))

    def chain_to(self, block_id: int) -> list[int]:
        """The indexed pages from the start of `block_id`'s chain to it."""
        chain = [block_id]
        parent = self.pages[block_id].parent_hash
        while parent is not None:
            chain.append(self.by_hash[parent])  # an indexed page's parent is indexed
            parent = self.pages[chain[-1]].parent_hash
        return chain[::-1]

    def unindex_tree(self, block_id: int) -> list[int]:
        """Unindexes a page and every indexed page chained after it; returns them."""
        gone = []
        stack = [block_id]
        while stack:
            b = stack.pop()
            page = self.pages.pop(b)
            del self.by_hash[page.block_hash]
            stack.extend(self.children.pop(page.block_hash, ()))
            if page.parent_hash is not None:
                siblings = self.children.get(page.parent_hash)
                if siblings is not None:
                    siblings.discard(b)
                    if not siblings:
                        del self.children[page.parent_hash]
            self.shares.remove_page(page.root)
            for tag in self.tags.pop(b, ()):
                self.tagged[tag].discard(b)
                if not self.tagged[tag]:
                    del self.tagged[tag]
            self.hits.pop(b, None)
            self.last_access.pop(b, None)
            gone.append(b)
        return gone

    def remap(self, remap: PageRemap) -> None:
        self.by_hash = remap.values(self.by_hash)
        self.pages = remap.keys(self.pages)
        self.children = {h: set(remap.ids(pages)) for h, pages in self.children.items()}
        self.tags = remap.keys(self.tags)
        self.tagged = {tag: set(remap.ids(pages)) for tag, pages in self.tagged.items()}
        self.hits = remap.keys(self.hits)
        self.last_access = remap.keys(self.last_access)
