"""Allocates pages to sequences: the one place that edits page tables.

    page table of a sequence with block_size 4 and 6 tokens:

        page 7: [t0 t1 t2 t3]   full
        page 2: [t4 t5 .  .]    partial: the next 2 tokens land here

Pages are shared between sequences by reference count: through the prefix
index (`find_prefix` + `adopt_prefix`: full pages whose chained hash and tokens
match), a session's context pool (`cache/session_pool.py`), or `fork`. A
shared or indexed page is read-only: before a sequence writes into one that is
partly filled, it gets a private copy (copy-on-write); the copy is returned in
`Allocation.copies` and the caller performs it on the device before the step
writes. Full pages are indexed as soon as their tokens are computed
(`commit`), so requests running at the same time already share them. Which
idle cached page goes first when pages run out is the pool's eviction policy.

With lower tiers (`kvtierd/tiers`), the tenant's index hit is extended by the
chunks stored in the host or disk tier that continue it: `find_prefix` finds
them; the scheduler loads them in two phases (`begin_load` takes fresh pages
and submits the loads to the transfer workers, `load_ready` / `finish_load`
index them once they arrived, `cache/loading.py`), then adopts them like any
cached page; `adopt_prefix` given such a hit loads them before returning
(tools and benchmarks, never the step). Pages evicted for capacity are saved below by
`demote_evicted` before anything writes into them; a session's finished turn
is written through to disk (`write_through`), and `flush_below` writes what
should outlive a restart. An invalidation reaches the lower tiers too: a
session's by its pages' keys, any other by a new tier epoch (all of it).

Public prefixes live in their own namespace, which every tenant's lookup also
tries. A tenant's pages after a public prefix chain from the public page's
hash rebased onto the tenant's root (`block_hash.rebase`), so only the public
part is ever shared.

Compaction (`cache/compaction.py`): between two steps, `plan_compaction`
says which live pages move where, the caller copies their KV on the device,
and `apply_compaction` renames them in the block pool, the page tables, the
session pools and the pins.

QoS and pins: a high-class sequence (`high=True` at its first allocation or
adoption) may take the pool's reserved pages, and its pages count against the
reserve (`cache/reserved_region.py`). Pinned prefixes and sessions
(`cache/pins.py`) keep their pages; a pinned session's pool never expires.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from kvtierd.cache.block_hash import BlockHash, hash_full_blocks, rebase
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.compaction import CompactionPlan, plan_compaction, rename_pages
from kvtierd.cache.loading import LoadTicket, Loading
from kvtierd.cache.fragmentation import Fragmentation, PageUse, measure, page_use
from kvtierd.cache.page_table import PageTable
from kvtierd.cache.pins import Pin, PinBudgetError, PinError, Pins
from kvtierd.cache.reserved_region import ReservedRegion
from kvtierd.cache.retention import Retention
from kvtierd.cache.session_pool import SessionChain, SessionKey, SessionPools
from kvtierd.tiers.chunk import ChunkCopy, ChunkSpan, FoundChunk, spans_of
from kvtierd.tiers.restore_planner import NOTHING_BELOW, RestorePlan
from kvtierd.tiers.tier_manager import PIN_TIERS, TierManager, TierPinError


log = logging.getLogger(__name__)

@dataclass(slots=True)
class Allocation:
    slots: list[int]  # one cache slot per new token, in order
    copies: list[tuple[int, int]]  # (src page, dst page) to copy before writing


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


@dataclass(slots=True)
class PrefixHit:
    block_ids: list[int]  # the last one may be partly used (a session hit)
    block_hashes: list[BlockHash]  # of the leading full pages
    num_tokens: int
    source: str = "none"  # "session", "prefix" (the tenant's index) or "public"
    public_blocks: int = 0  # leading pages from the public namespace
    own_from: int = 0  # for a session: its first page not adopted from the prefix index
    below: list[FoundChunk] = field(default_factory=list)  # planned: chunks to load after block_ids (in num_tokens)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # adopted: tokens loaded from "host" / "disk"
    restore: RestorePlan = NOTHING_BELOW  # adopted: whether `below` was loaded or left to recompute


NO_HIT = PrefixHit([], [], 0)
LOAD_POLL_S = 0.05  # the longest an engine with nothing but loads to wait for sleeps before looking again


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction_policy: str = "lru",
        prefix_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        hash_algorithm: str = "md5",
        prefix_min_hits_per_hour: float = 0.0,
        session_idle_ttl_s: float = 0.0,
        public_root: BlockHash | None = None,
        tiers: TierManager | None = None,
        reserve: ReservedRegion | None = None,
        pin_budget_pages: int = 0,
        shares: CacheShares | None = None,
    ) -> None:
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self.public_root = public_root  # the namespace every tenant may hit; None: no public prefixes
        self.pool = BlockPool(num_blocks, eviction_policy, prefix_ttl_s, clock, prefix_min_hits_per_hour, shares)
        self.tiers = tiers  # host and disk below the device; None: the device only
        if tiers is not None:
            self.pool.chunk_pages = tiers.chunk_pages
        self.pool.reserve = reserve
        self.sessions = SessionPools(session_idle_ttl_s, clock)
        self.pins = Pins(self.pool, pin_budget_pages, clock)
        self._clock = clock
        self._tables: dict[str, PageTable] = {}
        self.loading = Loading(self.pool, tiers, block_size, self.demote_evicted) if tiers is not None else None
        self._invalidations = 0  # a load begun before an invalidation indexes nothing
        self._storing: list[tuple[list[Future], list[int]]] = []  # stores being copied out, and the pages they hold
        self._retention: dict[str, Retention] = {}  # sequence -> its soft-retention hint (cache/retention.py)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def capacity_tokens(self, high: bool = True) -> int:
        """Tokens one sequence could ever hold: a lower-class one never gets the largest reserve."""
        pages = self.pool.num_blocks
        if not high and self.pool.reserve is not None:
            pages -= self.pool.reserve.ceiling
        return pages * self.block_size

    def table(self, seq_id: str) -> PageTable:
        return self._tables[seq_id]

    def block_ids(self, seq_id: str) -> list[int]:
        return self._tables[seq_id].block_ids

    def allocate_slots(self, seq_id: str, num_new_tokens: int, high: bool = False) -> Allocation | None:
        """Assigns slots to the next tokens of `seq_id`, or None when pages run out (nothing changes then).
        `high` applies to a sequence's first allocation (its class stays with its page table)."""
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = PageTable(self.block_size, high=high)
        last = table.block_ids[-1] if table.last_block_is_partial else None
        cow = last is not None and num_new_tokens > 0 and (
            self.pool.ref_count(last) > 1 or self.pool.page_info(last) is not None)
        fresh = self.pool.allocate(table.num_new_blocks(num_new_tokens) + cow, table.high)
        if fresh is None:
            if not table.block_ids:
                del self._tables[seq_id]
            return None
        copies = []
        if cow:
            private = fresh.pop(0)
            copies.append((last, private))
            table.block_ids[-1] = private
            self.pool.release([last], table.high)
        elif last is not None and num_new_tokens:
            self.pool.note_write(last)
        table.block_ids.extend(fresh)
        slots = table.slots(table.num_tokens, num_new_tokens)
        table.num_tokens += num_new_tokens
        return Allocation(slots=slots, copies=copies)

    # -- finding and adopting cached KV ---------------------------------------------------

    def find_prefix(self, root: BlockHash, token_ids: Sequence[int], session_id: str | None = None,
                    below: bool = True) -> PrefixHit:
        """The longest cached start of `token_ids`, leaving at least one token to
        compute (its logits give the next token): from the session's pool (to the
        token), the tenant's prefix index or the public one (whole pages). `below`: the
        tenant's index hit is extended by the chunks the lower tiers hold."""
        best = self._index_hit(root, token_ids, below)
        if self.public_root is not None and root != self.public_root and self.pool.has_namespace(self.public_root):
            public = self._public_hit(root, token_ids)
            if public.num_tokens > best.num_tokens:
                best = public
        if session_id is not None:
            session = self._session_hit((root, session_id), token_ids)
            if session.num_tokens > best.num_tokens:
                best = session
        return best

    def _lookup(self, parent: BlockHash, token_ids: Sequence[int]) -> tuple[list[int], list[BlockHash]]:
        bs = self.block_size
        n = len(token_ids) // bs
        hashes = hash_full_blocks(parent, token_ids[: n * bs], bs, algorithm=self.hash_algorithm)
        blocks = self.pool.lookup(hashes, [token_ids[i * bs : (i + 1) * bs] for i in range(n)])
        return blocks, hashes[: len(blocks)]

    def _index_hit(self, root: BlockHash, token_ids: Sequence[int], below: bool = True) -> PrefixHit:
        usable = token_ids[: len(token_ids) - 1]
        if self.tiers is None or not below:
            blocks, hashes = self._lookup(root, usable)
            return PrefixHit(blocks, hashes, len(blocks) * self.block_size, "prefix" if blocks else "none",
                             own_from=len(blocks))
        bs = self.block_size
        n = len(usable) // bs
        hashes = hash_full_blocks(root, usable[: n * bs], bs, algorithm=self.hash_algorithm)
        blocks = self.pool.lookup(hashes, [usable[i * bs : (i + 1) * bs] for i in range(n)])
        below = self.tiers.lookup(root, hashes, usable, len(blocks))
        end = below[-1].span.first_page + below[-1].span.num_pages if below else len(blocks)
        return PrefixHit(blocks, hashes[: len(blocks)], end * bs, "prefix" if end else "none", own_from=len(blocks),
                         below=below)

    def _public_hit(self, root: BlockHash, token_ids: Sequence[int]) -> PrefixHit:
        usable = token_ids[: len(token_ids) - 1]
        blocks, hashes = self._lookup(self.public_root, usable)
        if not blocks:
            return NO_HIT
        k = len(blocks)
        more, more_hashes = self._lookup(rebase(hashes[-1], root, self.hash_algorithm), usable[k * self.block_size :])
        n = k + len(more)
        return PrefixHit(blocks + more, hashes + more_hashes, n * self.block_size, "public", k, n)

    def _session_hit(self, key: SessionKey, token_ids: Sequence[int]) -> PrefixHit:
        chain = self.sessions.get(key)
        if chain is None:
            return NO_HIT
        n = 0
        limit = min(len(chain.token_ids), len(token_ids) - 1)
        while n < limit and chain.token_ids[n] == token_ids[n]:
            n += 1
        bs = self.block_size
        for i in range(-(-n // bs)):  # each page must still hold what the chain kept
            if self.pool.generation[chain.block_ids[i]] != chain.generations[i]:
                n = i * bs
                break
        if n == 0:
            return NO_HIT
        full = n // bs
        return PrefixHit(chain.block_ids[: -(-n // bs)], chain.block_hashes[:full], n, "session",
                         min(chain.public_blocks, full), min(chain.own_from, full))

    def adopt_prefix(self, seq_id: str, hit: PrefixHit, tag: str | None = None, high: bool = False) -> PrefixHit:
        """Starts `seq_id`'s page table with the hit's pages (shared, read-only). A hit with chunks below is
        loaded first, blocking (tools and benchmarks; the scheduler loads in two phases, `begin_load`).
        Returns what was adopted: less than found when a chunk finds no free pages or is gone from its tier
        (the rest is computed instead)."""
        assert seq_id not in self._tables, f"sequence {seq_id} already has pages"
        if hit.below:
            hit = self._load_now(seq_id, hit, high)
        self.pool.touch(hit.block_ids, high)
        if tag is not None:
            self.pool.tag(hit.block_ids, tag)
        self._tables[seq_id] = PageTable(self.block_size, list(hit.block_ids), hit.num_tokens,
                                         list(hit.block_hashes), hit.public_blocks, hit.own_from, high)
        return hit

    def _load_now(self, seq_id: str, hit: PrefixHit, high: bool) -> PrefixHit:
        plan = self.begin_load(seq_id, hit, high)
        if seq_id not in self.loading:
            return replace(on_device(hit, self.block_size), restore=plan)
        while not self.load_ready(seq_id):
            self.loading.wait(LOAD_POLL_S)
        ticket = self.finish_load(seq_id)
        # Loaded pages count as this sequence's own: a session that brought them back may drop them.
        return PrefixHit(ticket.chain_blocks, ticket.chain_hashes, len(ticket.chain_blocks) * self.block_size,
                         "prefix" if ticket.chain_blocks else "none", own_from=len(hit.block_ids),
                         tokens_by_tier=ticket.tokens_by_tier, restore=ticket.plan)

    # -- two-phase loads (cache/loading.py) ----------------------------------------------------

    def begin_load(self, seq_id: str, hit: PrefixHit, high: bool = False) -> RestorePlan:
        """Starts loading the chunks of `hit` found below, as many as the restore planner finds cheaper than
        recomputing and pages allow; `seq_id` is loading (`seq_id in loading`) unless none was started.
        Returns the plan."""
        if self.loading is None or not hit.below:
            return NOTHING_BELOW
        return self.loading.begin(seq_id, hit.block_ids, hit.block_hashes, hit.below, high, self._invalidations)

    def look_below(self, seq_id: str, root: BlockHash, token_ids: Sequence[int], high: bool = False) -> RestorePlan:
        """Looks up what the lower tiers hold past the tenant's device hit for `token_ids`, off the step (its
        arrival's lookup when still valid, `prefetch`). `seq_id in loading` after it when it is looking up or
        loading now (the scheduler's two phases: `load_ready`, then `finish_load`); otherwise nothing below is
        to be loaded, and the plan says why."""
        if self.loading is None:
            return NOTHING_BELOW
        bs = self.block_size
        usable = token_ids[: len(token_ids) - 1]
        n = len(usable) // bs
        hashes = hash_full_blocks(root, usable[: n * bs], bs, algorithm=self.hash_algorithm)
        blocks = self.pool.lookup(hashes, [usable[i * bs : (i + 1) * bs] for i in range(n)])
        if len(blocks) == n:
            self.loading.forget(seq_id)
            return NOTHING_BELOW
        tiers, start = self.tiers, len(blocks)
        return self.loading.look_up(seq_id, blocks, hashes[:start], lambda: tiers.lookup(root, hashes, usable, start),
                                    (n - start) * bs, high, self._invalidations)

    def load_ready(self, seq_id: str) -> bool:
        """Its loads have all finished, or its deadline passed: `finish_load` it, then adopt its prefix."""
        return self.loading.ready(seq_id)

    def finish_load(self, seq_id: str) -> LoadTicket:
        """Indexes what a ready sequence loaded and lets go of the pages it held (its admission takes them
        from the index)."""
        return self.loading.finish(seq_id, self._invalidations)

    def wait_for_loads(self, timeout_s: float = LOAD_POLL_S) -> None:
        """Blocks until a load finishes, a loading sequence's deadline passes, or `timeout_s` (an engine with
        nothing else to do)."""
        if self.loading is not None:
            self.loading.wait(timeout_s)

    def reap_loads(self) -> None:
        """Takes back the pages of abandoned loads that have finished; call between steps."""
        if self.loading is not None:
            self.loading.reap()
        self.reap_stores()

    def prefetch(self, root: BlockHash, token_ids: Sequence[int], seq_id: str | None = None) -> None:
        """Starts moving a prompt's chunks that sit below the host tier up to it, before its request is
        scheduled (on the tier manager's prefetch thread), and, given its `seq_id`, the request's lookup of the
        lower tiers (on a lookup worker: `look_below` uses its answer)."""
        if self.tiers is None:
            return
        bs = self.block_size
        usable = token_ids[: len(token_ids) - 1]
        n = len(usable) // bs
        hashes = hash_full_blocks(root, usable[: n * bs], bs, algorithm=self.hash_algorithm)
        on_device = self.pool.lookup(hashes, [usable[i * bs : (i + 1) * bs] for i in range(n)])
        if len(on_device) < n:
            tiers, start = self.tiers, len(on_device)
            tiers.prefetch(root, hashes, usable, start)
            if seq_id is not None:
                self.loading.look_ahead(seq_id, start, lambda: tiers.lookup(root, hashes, usable, start))

    # -- saving below the device ----------------------------------------------------------------

    def demote_evicted(self) -> None:
        """Saves below the chunks of pages evicted for capacity since the last call. Call before anything
        writes into a reused page (the engine: before each forward)."""
        evicted, self.pool.evicted = self.pool.evicted, []
        if evicted and self.tiers is not None:
            self.tiers.demote([ChunkCopy(ChunkSpan(c.root, c.first_depth, c.block_hashes, c.token_ids), c.block_ids,
                                         c.hits) for c in evicted])

    def save_ahead(self, max_pages: int) -> int:
        """Saves to the host tier the chunks of the idle pages next in line for eviction (up to `max_pages`
        pages), so that evicting them later copies nothing; returns the chunks saved. Call when idle."""
        if self.tiers is None or self.tiers.host is None:
            return 0
        chunks = self.pool.chunks_next_in_line(max_pages)
        return self.tiers.save_ahead([ChunkCopy(ChunkSpan(c.root, c.first_depth, c.block_hashes, c.token_ids),
                                                c.block_ids, c.hits) for c in chunks])

    @property
    def shares_every_request(self) -> bool:
        return self.tiers is not None and self.tiers.shares_every_request

    def write_through(self, seq_id: str, root: BlockHash, token_ids: Sequence[int],
                      session: bool = True) -> tuple[bytes, ...]:
        """Writes the full pages of `token_ids` (computed by `seq_id`) below: a session's finished turn to
        the disk tier and the fleet's, so the session outlives a restart, a crash or its host; any other
        finished request's prompt to the fleet's when it shares every request. Chunks already there are
        skipped. Returns a session turn's disk keys, for the SQL catalog (`TierManager.write_turn`)."""
        if self.tiers is None or not self.tiers.can_write_through:
            return ()
        table = self._tables[seq_id]
        if table.public_blocks:
            return ()  # its chain starts in the public namespace: not stored below in this version
        hashes = table.block_hashes[: len(token_ids) // self.block_size]
        copies = self._copies(root, hashes, token_ids, table.block_ids)
        held = [b for c in copies for b in c.block_ids]
        copied: list[Future] = []
        keys = self.tiers.write_turn(copies, session=session, copied=copied)
        if copied:  # its pages stay referenced until their copy out is made (off the step)
            self.pool.share(held)
            self._storing.append((copied, held))
        return keys

    def reap_stores(self, wait: bool = False) -> None:
        """Lets go of the pages of stores whose copy out of the device is made (all of them, waiting, with
        `wait`); call between steps."""
        still = []
        for copied, held in self._storing:
            if wait or all(f.done() for f in copied):
                for f in copied:
                    f.exception()  # waits; a failed copy is the writer's to log (it stores nothing)
                self.pool.release(held)
            else:
                still.append((copied, held))
        self._storing = still

    def flush_below(self) -> bool:
        """Queues for the disk tier what should outlive a restart: the sessions' resident pages and the
        prefixes hit at least once (before a graceful shutdown). False when the writer's queue filled up
        first: `tiers.wait()` (off the event loop), then call again; what is queued or stored is skipped."""
        if self.tiers is None or not self.tiers.has_disk:
            return True
        copies: list[ChunkCopy] = []
        for (root, _), chain in self.sessions:
            if chain.public_blocks:
                continue
            resident = 0
            while resident < len(chain.block_hashes) and \
                    self.pool.generation[chain.block_ids[resident]] == chain.generations[resident]:
                resident += 1
            copies += self._copies(root, chain.block_hashes[:resident], chain.token_ids, chain.block_ids)
        hit = {b: page for b, page in self.pool.cached_blocks() if self.pool.hits.get(b, 0)}
        continued = {page.parent_hash for page in hit.values()}
        for b, page in hit.items():
            if page.block_hash in continued:
                continue  # a longer hit prefix holds it
            chain = self.pool.chain_to(b)
            pages = [self.pool.page_info(c) for c in chain]
            if all(p.root == page.root for p in pages):
                copies += self._copies(page.root, [p.block_hash for p in pages], [t for p in pages for t in p.tokens],
                                       chain)
        return self.tiers.write_through(copies)

    def _copies(self, root: BlockHash, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
                block_ids: Sequence[int]) -> list[ChunkCopy]:
        """The chain's chunks, each with its device pages when `block_ids` has them all (else none)."""
        assert self.tiers is not None
        spans = spans_of(root, block_hashes, token_ids, self.block_size, self.tiers.chunk_pages)
        return [ChunkCopy(s, tuple(block_ids[s.first_page : s.first_page + s.num_pages])
                          if len(block_ids) >= s.first_page + s.num_pages else ()) for s in spans]

    def commit(self, seq_id: str, root: BlockHash, token_ids: Sequence[int], num_computed: int,
               tag: str | None = None) -> None:
        """Indexes the pages of `seq_id` that the first `num_computed` tokens fill."""
        table = self._tables[seq_id]
        done = len(table.block_hashes)
        bs = self.block_size
        if num_computed // bs <= done:
            return
        prev = table.block_hashes[-1] if done else None
        if prev is None:
            chain = root
        elif done == table.public_blocks:
            chain = rebase(prev, root, self.hash_algorithm)  # the first page of the tenant's own after a public prefix
        else:
            chain = prev
        new = hash_full_blocks(chain, token_ids[done * bs : num_computed - num_computed % bs], bs,
                               algorithm=self.hash_algorithm)
        for i, h in enumerate(new, start=done):
            self.pool.cache(table.block_ids[i], h, token_ids[i * bs : (i + 1) * bs], root, depth=i, parent=prev)
            prev = h
        if tag is not None:
            self.pool.tag(table.block_ids[done : done + len(new)], tag)
        table.block_hashes.extend(new)

    # -- sessions ------------------------------------------------------------------------

    def keep_session(self, seq_id: str, key: SessionKey, token_ids: Sequence[int], num_computed: int) -> None:
        """Keeps the first `num_computed` tokens' pages of `seq_id` as the session's
        context pool, for its next turn (call before `free`)."""
        table = self._tables.get(seq_id)
        if table is None or num_computed == 0:
            return
        pages = table.block_ids[: -(-num_computed // self.block_size)]
        self.sessions.keep(key, SessionChain(
            token_ids=array("i", token_ids[:num_computed]), block_ids=list(pages),
            generations=[self.pool.generation[b] for b in pages],
            block_hashes=table.block_hashes[: num_computed // self.block_size],
            public_blocks=table.public_blocks, own_from=table.own_from, last_used=0.0))
        pin = self.pins.session_pin(key)
        if pin is not None and pin.tier == "device":
            self.pins.follow(pin, list(pages))
        elif pin is not None:
            self._follow_below(pin, key)

    def session_view(self, key: SessionKey, now: float | None = None) -> SessionView | None:
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

    def drop_session(self, key: SessionKey) -> int:
        """Forgets a session's pool and unindexes the pages it computed itself (not
        those it adopted from the prefix index) and what was chained after them; returns how many."""
        chain = self.sessions.forget(key)
        if chain is None:
            return 0
        self._invalidations += 1
        if self.tiers is not None:
            self.tiers.forget(chain.block_hashes[chain.own_from :])
        return self._drop_chain(chain)

    def expire_sessions(self, now: float | None = None) -> int:
        """Drops the KV of sessions idle past their TTL; returns the pages unindexed."""
        pinned = {p.session_key for p in self.pins if p.session_key is not None}
        n = sum(self._drop_chain(chain) for _, chain in self.sessions.expired(now, keep=pinned))
        self.pool.evictions.expired += n
        return n

    def _drop_chain(self, chain: SessionChain) -> int:
        n = 0
        for b, h in list(zip(chain.block_ids, chain.block_hashes))[chain.own_from :]:
            page = self.pool.page_info(b)
            if page is not None and page.block_hash == h:  # still this chain's page (it may be gone)
                n += self.pool.unindex_subtree(b)
        return n

    # -- invalidation ----------------------------------------------------------------------

    def invalidate_prefix(self, root: BlockHash, token_ids: Sequence[int]) -> int:
        """Unindexes the cached pages of `token_ids` (full pages) and what was chained after them,
        sparing pages other prefixes share; returns how many."""
        blocks, _ = self._lookup(root, token_ids)
        n = self.pool.unindex_from(blocks[-1]) if blocks else 0
        self.pool.evictions.invalidated += n
        self._invalidate_below()
        return n

    def invalidate_hash(self, block_hash: BlockHash) -> int:
        b = self.pool.block_of(block_hash)
        n = self.pool.unindex_from(b) if b is not None else 0
        self.pool.evictions.invalidated += n
        self._invalidate_below()
        return n

    def invalidate_session(self, key: SessionKey) -> int:
        n = self.drop_session(key)
        self.pool.evictions.invalidated += n
        return n

    def invalidate_namespace(self, root: BlockHash) -> int:
        """Drops every cached page and session pool of a namespace (a tenant's cache flushed); returns pages.

        Sequences holding some keep reading them; those pages are freed uncached."""
        self.sessions.forget_namespace(root)
        self._invalidate_below()
        return self.pool.invalidate_namespace(root)

    def invalidate_tag(self, tag: str) -> int:
        self._invalidate_below()
        return self.pool.invalidate_tag(tag)

    def invalidate_all(self) -> int:
        self.sessions.forget_all()
        self._invalidate_below()
        return self.pool.invalidate_all()

    def _invalidate_below(self) -> None:
        # The lower tiers know no namespaces or tags: all they hold goes (a session's chunks go by key).
        self._invalidations += 1
        if self.tiers is not None:
            self.tiers.invalidate_all()

    def expire(self, now: float | None = None) -> int:
        """Evicts a bounded number of expired idle cached pages and idle sessions' KV; call between steps."""
        for pin in self.pins.expire(now):
            if pin.tier != "device" and self.tiers is not None:
                self.tiers.unpin(pin.pin_id)
        return self.pool.expire(now) + self.expire_sessions(now)

    # -- pins --------------------------------------------------------------------------------

    def pin_prefix(self, pin_id: str, root: BlockHash, token_ids: Sequence[int], ttl_s: float | None = None,
                   tier: str = "device") -> Pin | None:
        """Pins the full pages of `token_ids` in namespace `root` on the device, or their chunks in the host or
        disk tier; None when they are not all cached (compute the prefix, then pin again). Raises PinError
        (over budget, too short, no such tier)."""
        n = len(token_ids) // self.block_size
        if n == 0:
            raise PinError(f"a prefix of {len(token_ids)} tokens has no full page of {self.block_size} to pin")
        pin = Pin(pin_id, "prefix", root, self._expiry(ttl_s), tuple(token_ids), tier=tier)
        full = token_ids[: n * self.block_size]
        blocks, hashes = self._lookup(root, full)
        if tier != "device":
            if len(hashes) < n:  # the chain's hashes, whether or not its pages are on the device
                hashes = hash_full_blocks(root, full, self.block_size, algorithm=self.hash_algorithm)
            return self._pin_below(pin, self._copies(root, hashes, full, blocks))
        if len(blocks) < n:
            return None
        return self.pins.add(pin, blocks)

    def pin_session(self, pin_id: str, key: SessionKey, ttl_s: float | None = None, tier: str = "device") -> Pin:
        """Pins a session's context pool (its resident pages on the device, its chunks in the host or disk
        tier) and keeps pinning it as it grows (see cache/pins.py)."""
        pin = Pin(pin_id, "session", key[0], self._expiry(ttl_s), session_id=key[1], tier=tier)
        if tier != "device":
            pinned = self._pin_below(pin, self._session_copies(key))
            if pinned is None:
                raise PinError(f"session {key[1]!r}'s KV is neither on the device nor in the {tier} tier any more; "
                               "pin it after its next turn")
            return pinned
        return self.pins.add(pin, self._resident_pages(key))

    def unpin(self, pin_id: str) -> Pin | None:
        pin = self.pins.remove(pin_id)
        if pin is not None and pin.tier != "device" and self.tiers is not None:
            self.tiers.unpin(pin_id)
        return pin

    def _resident_pages(self, key: SessionKey) -> list[int]:
        """The session pool's leading pages still holding its KV."""
        chain = self.sessions.get(key)
        pages: list[int] = []
        if chain is not None:
            for b, gen in zip(chain.block_ids, chain.generations):
                if self.pool.generation[b] != gen:
                    break
                pages.append(b)
        return pages

    def _session_copies(self, key: SessionKey) -> list[ChunkCopy]:
        """The chunks of a session's chain, with the device pages of those still resident."""
        chain = self.sessions.get(key)
        if chain is None:
            return []
        if chain.public_blocks:
            raise PinError("a session that starts with a public prefix can be pinned on the device only")
        return self._copies(key[0], chain.block_hashes, chain.token_ids, self._resident_pages(key))

    def _pin_below(self, pin: Pin, copies: list[ChunkCopy]) -> Pin | None:
        if pin.tier not in PIN_TIERS:
            raise PinError(f"tier must be device, {' or '.join(PIN_TIERS)}, not {pin.tier!r}")
        if self.tiers is None:
            raise PinError(f"there is no {pin.tier} tier: turn the lower tiers on, or pin to the device")
        share = self.pins.budget_pages / self.pool.num_blocks
        try:
            if not self.tiers.pin(pin.tier, pin.pin_id, copies, share):
                return None
        except TierPinError as e:
            raise (PinBudgetError if "budget" in str(e) else PinError)(str(e)) from e
        return self.pins.add(pin, [])

    def _follow_below(self, pin: Pin, key: SessionKey) -> None:
        """Moves a session's pin below the device to its chain after a turn (its new chunks are written there
        now, on this thread); past the tier's budget the pin keeps what it held."""
        try:
            self._pin_below(pin, self._session_copies(key))
        except PinError as e:
            log.warning("pin %s keeps its earlier turns only: %s", pin.pin_id, e)

    def _expiry(self, ttl_s: float | None) -> float | None:
        return None if ttl_s is None else self._clock() + ttl_s

    # -- compaction --------------------------------------------------------------------------

    def page_use(self) -> PageUse:
        return page_use(self.pool, self._tables.values(), self.sessions, self.pins)

    def fragmentation(self) -> Fragmentation:
        return measure(self.page_use())

    def plan_compaction(self) -> CompactionPlan:
        """Where each live page goes (cache/compaction.py). Copy `plan.copies` on the device, then
        `apply_compaction(plan)`, with nothing in between: call between two engine steps."""
        self.demote_evicted()  # evicted chunks are saved below from the pages they are in now
        self.reap_stores(wait=True)  # no store may be reading a page while it moves
        return plan_compaction(self.page_use())

    def apply_compaction(self, plan: CompactionPlan) -> None:
        """Renames every page as `plan` says, once its copies were made on the device."""
        rename_pages(plan, self.pool, self._tables.values(), self.sessions, self.pins)

    # -- lifetime --------------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """Makes `child_id` share every page of `parent_id` (e.g. for n > 1 samples)."""
        parent = self._tables[parent_id]
        assert child_id not in self._tables, f"sequence {child_id} already has pages"
        self.pool.share(parent.block_ids, parent.high)
        self._tables[child_id] = PageTable(
            self.block_size, list(parent.block_ids), parent.num_tokens, list(parent.block_hashes), parent.public_blocks,
            parent.own_from, parent.high
        )

    def retain(self, seq_id: str, retention: Retention) -> None:
        """A soft-retention hint for the pages `seq_id` releases, each time it does, until it is finished."""
        self._retention[seq_id] = retention

    def free(self, seq_id: str, finished: bool = False) -> None:
        """Returns a sequence's pages, and abandons its loads; a no-op for a sequence that holds none.
        `finished`: it will not come back (a preempted one does), so its retention hint goes too."""
        if self.loading is not None:
            self.loading.cancel(seq_id)
            self.loading.forget(seq_id)
        table = self._tables.pop(seq_id, None)
        retention = self._retention.pop(seq_id, None) if finished else self._retention.get(seq_id)
        if table is not None:
            self.pool.release(table.block_ids, table.high, retention)


def on_device(hit: PrefixHit, block_size: int) -> PrefixHit:
    """A hit without the chunks found below: its device pages only."""
    if not hit.below:
        return hit
    n = len(hit.block_ids)
    return replace(hit, num_tokens=n * block_size, source=hit.source if n else "none", below=[])
