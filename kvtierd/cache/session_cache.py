"""Sessions' context pools over the block pool: keeping a turn's pages, viewing them, dropping them.

The pools themselves hold no page (`cache/session_pool.py`); this is where a
turn's page table becomes its session's chain, where a chain is read against
the pages' generations (what still holds the session's KV), and where a
dropped or expired session unindexes the pages it computed itself (not those
it adopted from the prefix index) and what was chained after them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.page_table import PageTable
from kvtierd.cache.pinning import Pinning
from kvtierd.cache.session_pool import SessionChain, SessionKey, SessionPools


@dataclass(frozen=True, slots=True)
class SessionPage:
    block_id: int
    num_tokens: int
    resident: bool  # still holds what the session left there
    indexed: bool  # also in the prefix index


@dataclass(frozen=True, slots=True)
class SessionView:
    num_tokens: int
    pages: list[SessionPage]
    idle_s: float


class SessionCache:
    def __init__(self, pool: BlockPool, sessions: SessionPools, pinning: Pinning, block_size: int) -> None:
        self.pool = pool
        self.sessions = sessions
        self.pinning = pinning
        self.block_size = block_size

    def keep(self, table: PageTable, key: SessionKey, token_ids: Sequence[int], num_computed: int) -> None:
        """Keeps the first `num_computed` tokens' pages of `table` as the session's context pool; its pin
        follows."""
        pages = table.block_ids[: -(-num_computed // self.block_size)]
        self.sessions.keep(key, SessionChain(
            token_ids=array("i", token_ids[:num_computed]), block_ids=list(pages),
            generations=[self.pool.generation[b] for b in pages],
            block_hashes=table.block_hashes[: num_computed // self.block_size],
            public_blocks=table.public_blocks, own_from=table.own_from, last_used=0.0))
        self.pinning.follow_session(key, list(pages))

    def view(self, key: SessionKey, now: float | None = None) -> SessionView | None:
        """A session's context pool as it stands: each page, and whether it still holds the session's KV."""
        chain = self.sessions.get(key)
        if chain is None:
            return None
        bs, n = self.block_size, len(chain.token_ids)
        pages = []
        for i, (b, gen) in enumerate(zip(chain.block_ids, chain.generations)):
            info = self.pool.page_info(b)
            indexed = info is not None and i < len(chain.block_hashes) and info.block_hash == chain.block_hashes[i]
            pages.append(SessionPage(b, min(bs, n - i * bs), self.pool.generation[b] == gen, indexed))
        now = self.sessions.now() if now is None else now
        return SessionView(n, pages, now - chain.last_used)

    def expire(self, now: float | None = None) -> int:
        """Drops the KV of sessions idle past their TTL (pinned ones stay); returns the pages unindexed."""
        keep = self.pinning.pinned_sessions()
        n = sum(self.drop(chain) for _, chain in self.sessions.expired(now, keep=keep))
        self.pool.evictions.expired += n
        return n

    def drop(self, chain: SessionChain) -> int:
        """Unindexes the pages a forgotten session computed itself and what was chained after them."""
        n = 0
        for b, h in list(zip(chain.block_ids, chain.block_hashes))[chain.own_from :]:
            page = self.pool.page_info(b)
            if page is not None and page.block_hash == h:  # still this chain's page (it may be gone)
                n += self.pool.unindex_subtree(b)
        return n
