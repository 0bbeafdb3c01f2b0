"""Session context pools: each chat session's KV, kept between its turns.

A session's context pool is the chain of pages its last turn left behind:
the tokens they hold, the pages, and each page's generation at that time. The
pool holds no reference, so the pages stay free for others to take under
pressure; a page is used again only while its generation is unchanged (the
block pool bumps it whenever a page is reallocated, written in place or
unindexed). That covers what the prefix index cannot:

- the last, partly filled page (never indexed) is reused, so a turn computes
  only its new tokens, not the tail of the previous reply again;
- an edited history reuses the pool up to the first differing token, not up
  to the last full page before it.

A session whose pool is unused for `idle_ttl_s` expires: its pool is
forgotten and the pages only it had go back to the free pages (its messages
stay in the session store).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.page_remap import PageRemap

SessionKey = tuple[BlockHash, str]  # (namespace root, session id): ids never cross tenants


@dataclass(slots=True)
class SessionChain:
    token_ids: array  # tokens whose K/V the pages hold, in order (int32: 4 bytes a token, not 36)
    block_ids: list[int]
    generations: list[int]  # of each page when the chain was kept
    block_hashes: list[BlockHash]  # chained hashes of the leading full pages
    public_blocks: int  # leading pages from the public namespace
    own_from: int  # its first page not adopted from the prefix index: what expiry may drop
    last_used: float

    def resident(self, generation: Sequence[int]) -> list[int]:
        """The leading pages that still hold what the session left there (`generation`: the block pool's)."""
        pages = []
        for b, gen in zip(self.block_ids, self.generations):
            if generation[b] != gen:
                break
            pages.append(b)
        return pages


class SessionPools:
    def __init__(self, idle_ttl_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if idle_ttl_s < 0:
            raise ValueError("session_idle_ttl_s must be 0 (never) or positive")
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._chains: dict[SessionKey, SessionChain] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def __iter__(self) -> Iterator[tuple[SessionKey, SessionChain]]:
        return iter(list(self._chains.items()))

    def now(self) -> float:
        return self._clock()

    def get(self, key: SessionKey) -> SessionChain | None:
        return self._chains.get(key)

    def keep(self, key: SessionKey, chain: SessionChain) -> None:
        chain.last_used = self._clock()
        self._chains.pop(key, None)
        self._chains[key] = chain  # most recently used last

    def forget(self, key: SessionKey) -> SessionChain | None:
        return self._chains.pop(key, None)

    def forget_namespace(self, root: BlockHash) -> list[SessionChain]:
        keys = [k for k in self._chains if k[0] == root]
        return [self._chains.pop(k) for k in keys]

    def forget_all(self) -> list[SessionChain]:
        chains = list(self._chains.values())
        self._chains.clear()
        return chains

    def expired(self, now: float | None = None, keep: Collection[SessionKey] = ()) -> list[tuple[SessionKey, SessionChain]]:
        """Forgets and returns the sessions idle for `idle_ttl_s` or longer, except those in `keep` (pinned)."""
        if not self.idle_ttl_s:
            return []
        now = self._clock() if now is None else now
        out = []
        for key, chain in list(self._chains.items()):  # least recently used first
            if now - chain.last_used < self.idle_ttl_s:
                break
            if key not in keep:
                out.append((key, self._chains.pop(key)))
        return out

    def remap(self, remap: PageRemap) -> None:
        """Renames the pages that still hold their session's KV (compaction); a stale one stays stale."""
        for chain in self._chains.values():
            for i, (b, gen) in enumerate(zip(chain.block_ids, chain.generations)):
                renamed = remap.weak(b, gen)
                if renamed is not None:
                    chain.block_ids[i], chain.generations[i] = renamed
