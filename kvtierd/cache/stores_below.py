"""Saving device pages below the device: the page side of stores to the lower tiers.

Pages evicted for capacity are saved below by `demote_evicted` before
anything writes into them (their chunks were logged by the block pool,
`cache/evicted_chunks.py`); `save_ahead` saves the chunks next in line for
eviction while the engine is idle, so evicting them later copies nothing. A
session's finished turn is written through to disk and the fleet's
(`write_through`): its pages stay referenced until the store-copy thread
has copied them out, and go back between steps (`reap_stores`). That copy
yields to steps like the writes it feeds (tiers/background_work.py), so a
chat's next turn, sent as the reply ends, runs before that copy, not behind it.
`flush_below` queues what should outlive a restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, wait

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.evicted_chunks import EvictedChunk
from kvtierd.cache.page_table import PageTable
from kvtierd.cache.session_pool import SessionPools
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.chunk import ChunkCopy, ChunkSpan, spans_of
from kvtierd.tiers.tier_manager import TierManager


class StoresBelow:
    def __init__(self, pool: BlockPool, tiers: TierManager | None, block_size: int) -> None:
        self.pool = pool
        self.tiers = tiers
        self.block_size = block_size
        self._storing: list[tuple[list[Future], list[int]]] = []  # stores being copied out, and the pages they hold

    def copies(self, root: BlockHash, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
               block_ids: Sequence[int]) -> list[ChunkCopy]:
        """The chain's chunks, each with its device pages when `block_ids` has them all (else none)."""
        assert self.tiers is not None
        spans = spans_of(root, block_hashes, token_ids, self.block_size, self.tiers.chunk_pages)
        return [ChunkCopy(s, tuple(block_ids[s.first_page : s.first_page + s.num_pages])
                          if len(block_ids) >= s.first_page + s.num_pages else ()) for s in spans]

    def demote_evicted(self) -> None:
        """Saves below the chunks of pages evicted for capacity since the last call. Call before anything
        writes into a reused page (the engine: before each forward)."""
        evicted, self.pool.evicted = self.pool.evicted, []
        if evicted and self.tiers is not None:
            self.tiers.demote(_chunk_copies(evicted))

    def save_ahead(self, max_pages: int) -> int:
        """Saves to the host tier the chunks of the idle pages next in line for eviction (up to `max_pages`
        pages), so that evicting them later copies nothing; returns the chunks saved. Call when idle."""
        if self.tiers is None or self.tiers.host is None:
            return 0
        return self.tiers.save_ahead(_chunk_copies(self.pool.chunks_next_in_line(max_pages)))

    def write_through(self, table: PageTable, root: BlockHash, token_ids: Sequence[int],
                      session: bool = True) -> tuple[bytes, ...]:
        """Writes the full pages of `token_ids` (computed by the sequence of `table`) below: a session's
        finished turn to the disk tier and the fleet's, so the session outlives a restart, a crash or its
        host; any other finished request's prompt to the fleet's when it shares every request. Chunks already
        there are skipped. Returns a session turn's disk keys, for the SQL catalog (`TierManager.write_turn`)."""
        if self.tiers is None or not self.tiers.can_write_through:
            return ()
        if table.public_blocks:
            return ()  # its chain starts in the public namespace: not stored below in this version
        hashes = table.block_hashes[: len(token_ids) // self.block_size]
        copies = self.copies(root, hashes, token_ids, table.block_ids)
        held = [b for c in copies for b in c.block_ids]
        copied: list[Future] = []
        keys = self.tiers.write_turn(copies, session=session, copied=copied)
        if copied:  # its pages stay referenced until their copy out is made (off the step)
            self.pool.share(held)
            self._storing.append((copied, held))
        return keys

    @property
    def num_copying(self) -> int:
        """Stores whose copy out of the device is not made yet (each holding its pages)."""
        return len(self._storing)

    def reap_stores(self, timeout_s: float | None = 0.0) -> bool:
        """Lets go of the pages of stores whose copy out of the device is made, waiting up to `timeout_s` for
        the others (None: for all of them, started now rather than at their deferral's end). Call between
        steps. True while some are still to be copied."""
        if self._storing and timeout_s != 0:
            if timeout_s is None:
                BACKGROUND_WORK.hurry()
            wait([f for copied, _ in self._storing for f in copied], timeout_s)
        still = []
        for copied, held in self._storing:
            if all(f.done() for f in copied):
                for f in copied:
                    f.exception()  # a failed copy is the writer's to log (it stores nothing)
                self.pool.release(held)
            else:
                still.append((copied, held))
        self._storing = still
        return bool(still)

    def flush_below(self, sessions: SessionPools) -> bool:
        """Queues for the disk tier what should outlive a restart: the sessions' resident pages and the
        prefixes hit at least once (before a graceful shutdown). False when the writer's queue filled up
        first: `tiers.wait()` (off the event loop), then call again; what is queued or stored is skipped."""
        if self.tiers is None or not self.tiers.has_disk:
            return True
        copies: list[ChunkCopy] = []
        for (root, _), chain in sessions:
            if chain.public_blocks:
                continue
            resident = len(chain.resident(self.pool.generation))
            copies += self.copies(root, chain.block_hashes[:resident], chain.token_ids, chain.block_ids)
        index = self.pool.index
        hit = {b: page for b, page in self.pool.cached_blocks() if index.hits.get(b, 0)}
        continued = {page.parent_hash for page in hit.values()}
        for b, page in hit.items():
            if page.block_hash in continued:
                continue  # a longer hit prefix holds it
            chain = index.chain_to(b)
            pages = [index.pages[c] for c in chain]
            if all(p.root == page.root for p in pages):
                copies += self.copies(page.root, [p.block_hash for p in pages], [t for p in pages for t in p.tokens],
                                      chain)
        return self.tiers.write_through(copies)


def _chunk_copies(chunks: list[EvictedChunk]) -> list[ChunkCopy]:
    return [ChunkCopy(ChunkSpan(c.root, c.first_depth, c.block_hashes, c.token_ids), c.block_ids, c.hits)
            for c in chunks]
