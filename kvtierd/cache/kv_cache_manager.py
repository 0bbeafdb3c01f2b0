"""Coordinates the cache's parts: page tables, the prefix index, sessions, pins and the tiers below.

    page table of a sequence with block_size 4 and 6 tokens:

        page 7: [t0 t1 t2 t3]   full
        page 2: [t4 t5 .  .]    partial: the next 2 tokens land here

Pages are shared by reference count: adopted from the prefix index or a
session's pool (`find_prefix` + `adopt_prefix`, `cache/prefix_lookup.py`), or
by `fork`. A shared or indexed page is read-only: before a sequence writes
into one that is partly filled, it gets a private copy (copy-on-write,
returned in `Allocation.copies` for the caller to make on the device; the
tables and every edit to them are `cache/page_tables.py`). Full pages are
indexed as soon as their tokens are computed (`commit`), so
requests running at the same time already share them. A request's page
hashes are computed once (`BlockHashes`, carried by the request) and handed
to each call that needs them.

The parts: two-phase loads from the lower tiers (`cache/loading.py`; the
scheduler's `look_below` / `load_ready` / `finish_load`, while `adopt_prefix`
given a hit with chunks below loads them before returning: tools and
benchmarks, never the step), stores below (`cache/stores_below.py`), session
pools (`cache/session_cache.py`), pins (`cache/pinning.py`), invalidation
(`cache/invalidation.py`). Compaction (`cache/compaction.py`):
`plan_compaction`, the caller copies the KV, then `apply_compaction` hands one
page remap (`cache/page_remap.py`) to every holder of page ids. A high-class
sequence (`high=True` at its first allocation or adoption) may take the
reserved pages (`cache/reserved_region.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvtierd.cache.block_hash import BlockHash, BlockHashes
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.compaction import CompactionPlan, plan_compaction
from kvtierd.cache.fragmentation import Fragmentation, PageUse, measure, page_use
from kvtierd.cache.invalidation import Invalidation
from kvtierd.cache.loading import LoadTicket, Loading
from kvtierd.cache.page_table import PageTable
from kvtierd.cache.page_tables import Allocation, PageTables
from kvtierd.cache.pinning import Pinning
from kvtierd.cache.pins import Pin, Pins
from kvtierd.cache.prefix_lookup import DeviceHit, PrefixHit, PrefixLookup, on_device
from kvtierd.cache.reserved_region import ReservedRegion
from kvtierd.cache.retention import Retention
from kvtierd.cache.session_cache import SessionCache, SessionView
from kvtierd.cache.session_pool import SessionKey, SessionPools
from kvtierd.cache.stores_below import StoresBelow
from kvtierd.tiers.restore_planner import NOTHING_BELOW, RestorePlan
from kvtierd.tiers.tier_manager import TierManager


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
        self.lookup = PrefixLookup(self.pool, self.sessions, block_size, hash_algorithm, public_root, tiers)
        self.stores = StoresBelow(self.pool, tiers, block_size)
        self.pinning = Pinning(self.pins, self.lookup, self.stores, self.sessions, tiers, clock)
        self.session_cache = SessionCache(self.pool, self.sessions, self.pinning, block_size)
        self.invalidation = Invalidation(self.pool, self.session_cache, self.lookup, tiers)
        self.tables = PageTables(self.pool, block_size, hash_algorithm)
        self.loading = Loading(self.pool, tiers, block_size, self.demote_evicted) if tiers is not None else None
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
        return self.tables[seq_id]

    def block_ids(self, seq_id: str) -> list[int]:
        return self.tables[seq_id].block_ids

    def hashes(self, root: BlockHash, hashes: BlockHashes | None = None) -> BlockHashes:
        """A sequence's page hashes in namespace `root`: `hashes` when given (made once, carried by the
        request), else new ones."""
        assert hashes is None or hashes.root == root, "a request's hashes belong to its namespace"
        return hashes if hashes is not None else self.lookup.hashes(root)

    def allocate_slots(self, seq_id: str, num_new_tokens: int, high: bool = False) -> Allocation | None:
        """Slots for the next tokens of `seq_id`, or None when pages run out (`PageTables.allocate`)."""
        return self.tables.allocate(seq_id, num_new_tokens, high)

    def allocated_slots(self, seq_id: str, start: int, num_tokens: int) -> Allocation:
        return self.tables.allocated(seq_id, start, num_tokens)

    # -- finding and adopting cached KV ---------------------------------------------------

    def device_hit(self, root: BlockHash, token_ids: Sequence[int], hashes: BlockHashes | None = None) -> DeviceHit:
        """`token_ids`' pages in the tenant's index, each confirmed by its tokens: an admission looks once and
        hands it to `look_below` and `find_prefix` (nothing between them changes the index)."""
        return self.lookup.device_hit(self.hashes(root, hashes), token_ids)

    def find_prefix(self, root: BlockHash, token_ids: Sequence[int], session_id: str | None = None,
                    below: bool = True, hashes: BlockHashes | None = None,
                    device: DeviceHit | None = None) -> PrefixHit:
        """The longest cached start of `token_ids` (`PrefixLookup.find`)."""
        return self.lookup.find(self.hashes(root, hashes), token_ids, session_id, below, device)

    def adopt_prefix(self, seq_id: str, hit: PrefixHit, tag: str | None = None, high: bool = False) -> PrefixHit:
        """Starts `seq_id`'s page table with the hit's pages (shared, read-only). A hit with chunks below is
        loaded first, blocking (tools and benchmarks; the scheduler loads in two phases, `look_below`).
        Returns what was adopted: less than found when a chunk finds no free pages or is gone from its tier
        (the rest is computed instead)."""
        assert seq_id not in self.tables, f"sequence {seq_id} already has pages"
        if hit.below:
            hit = self._load_now(seq_id, hit, high)
        self.pool.touch(hit.block_ids, high)
        if tag is not None:
            self.pool.tag(hit.block_ids, tag)
        self.tables.adopt(seq_id, hit, high)
        return hit

    def _load_now(self, seq_id: str, hit: PrefixHit, high: bool) -> PrefixHit:
        """Loads the chunks of `hit` found below, as many as the restore planner finds cheaper than
        recomputing and pages allow, waiting for them."""
        plan = self.loading.begin(seq_id, hit.block_ids, hit.block_hashes, hit.below, high, self.invalidation.count)
        if seq_id not in self.loading:
            return replace(on_device(hit, self.block_size), restore=plan)
        while not self.load_ready(seq_id):
            self.loading.wait(LOAD_POLL_S)
        ticket = self.finish_load(seq_id)
        # Loaded pages count as this sequence's own: a session that brought them back may drop them.
        n = min(len(ticket.chain_blocks) * self.block_size, hit.num_tokens)  # its last token stays to compute
        return PrefixHit(ticket.chain_blocks, ticket.chain_hashes[: n // self.block_size], n,
                         "prefix" if ticket.chain_blocks else "none", own_from=len(hit.block_ids),
                         tokens_by_tier=ticket.tokens_by_tier, restore=ticket.plan)

    # -- two-phase loads (cache/loading.py) ----------------------------------------------------

    def look_below(self, seq_id: str, root: BlockHash, token_ids: Sequence[int], high: bool = False,
                   hashes: BlockHashes | None = None, device: DeviceHit | None = None) -> RestorePlan:
        """Looks up what the lower tiers hold past the tenant's device hit for `token_ids`, off the step (its
        arrival's lookup when still valid, `prefetch`). `seq_id in loading` after it when it is looking up or
        loading now (the scheduler's two phases: `load_ready`, then `finish_load`); otherwise nothing below is
        to be loaded, and the plan says why."""
        if self.loading is None:
            return NOTHING_BELOW
        hit = device or self.device_hit(root, token_ids, hashes)
        if hit.complete:
            self.loading.forget(seq_id)
            return NOTHING_BELOW
        tiers, start = self.tiers, len(hit.block_ids)
        return self.loading.look_up(seq_id, hit.block_ids, hit.hashes[:start],
                                    lambda: tiers.lookup(root, hit.hashes, hit.token_ids, start),
                                    (len(hit.hashes) - start) * self.block_size, high, self.invalidation.count)

    def load_ready(self, seq_id: str) -> bool:
        """Its loads have all finished, or its deadline passed: `finish_load` it, then adopt its prefix."""
        return self.loading.ready(seq_id)

    def finish_load(self, seq_id: str) -> LoadTicket:
        """Indexes what a ready sequence loaded and lets go of the pages it held (its admission takes them
        from the index)."""
        return self.loading.finish(seq_id, self.invalidation.count)

    def wait_for_loads(self, timeout_s: float = LOAD_POLL_S) -> None:
        """Blocks until a load finishes, a loading sequence's deadline passes, or `timeout_s` (an engine with
        nothing else to do)."""
        if self.loading is not None:
            self.loading.wait(timeout_s)

    def reap_loads(self) -> None:
        """Takes back the pages of abandoned loads that have finished; call between steps."""
        if self.loading is not None:
            self.loading.reap()
        self.stores.reap_stores()

    def prefetch(self, root: BlockHash, token_ids: Sequence[int], seq_id: str | None = None,
                 hashes: BlockHashes | None = None) -> None:
        """Starts moving a prompt's chunks that sit below the host tier up to it, before its request is
        scheduled (on the tier manager's prefetch thread), and, given its `seq_id`, the request's lookup of the
        lower tiers (on a lookup worker: `look_below` uses its answer)."""
        if self.tiers is None:
            return
        hit = self.device_hit(root, token_ids, hashes)
        if not hit.complete:
            tiers, start = self.tiers, len(hit.block_ids)
            tiers.prefetch(root, hit.hashes, hit.token_ids, start)
            if seq_id is not None:
                self.loading.look_ahead(seq_id, start, lambda: tiers.lookup(root, hit.hashes, hit.token_ids, start))

    # -- saving below the device (cache/stores_below.py) ------------------------------------------

    def demote_evicted(self) -> None:
        self.stores.demote_evicted()

    def save_ahead(self, max_pages: int) -> int:
        return self.stores.save_ahead(max_pages)

    @property
    def shares_every_request(self) -> bool:
        return self.tiers is not None and self.tiers.shares_every_request

    def write_through(self, seq_id: str, root: BlockHash, token_ids: Sequence[int],
                      session: bool = True) -> tuple[bytes, ...]:
        return self.stores.write_through(self.tables[seq_id], root, token_ids, session)

    def reap_stores(self, timeout_s: float | None = 0.0) -> bool:
        return self.stores.reap_stores(timeout_s)

    def flush_below(self) -> bool:
        return self.stores.flush_below(self.sessions)

    def commit(self, seq_id: str, root: BlockHash, token_ids: Sequence[int], num_computed: int,
               tag: str | None = None, hashes: BlockHashes | None = None) -> None:
        """Indexes the pages of `seq_id` that the first `num_computed` tokens fill (`PageTables.index`)."""
        self.tables.index(seq_id, root, token_ids, num_computed, tag, hashes)

    # -- sessions (cache/session_cache.py) ------------------------------------------------------

    def keep_session(self, seq_id: str, key: SessionKey, token_ids: Sequence[int], num_computed: int) -> None:
        """Keeps the first `num_computed` tokens' pages of `seq_id` as the session's
        context pool, for its next turn (call before `free`)."""
        table = self.tables.get(seq_id)
        if table is not None and num_computed:
            self.session_cache.keep(table, key, token_ids, num_computed)

    def session_view(self, key: SessionKey, now: float | None = None) -> SessionView | None:
        return self.session_cache.view(key, now)

    # -- invalidation (cache/invalidation.py) ---------------------------------------------------

    def invalidate_prefix(self, root: BlockHash, token_ids: Sequence[int]) -> int:
        return self.invalidation.prefix(self.hashes(root), token_ids)

    def invalidate_hash(self, block_hash: BlockHash) -> int:
        return self.invalidation.hash(block_hash)

    def invalidate_session(self, key: SessionKey) -> int:
        return self.invalidation.session(key)

    def invalidate_namespace(self, root: BlockHash) -> int:
        return self.invalidation.namespace(root)

    def invalidate_tag(self, tag: str) -> int:
        return self.invalidation.tag(tag)

    def invalidate_all(self) -> int:
        return self.invalidation.all()

    def expire(self, now: float | None = None) -> int:
        """Evicts a bounded number of expired idle cached pages and idle sessions' KV; call between steps."""
        self.pinning.expire(now)
        return self.pool.expire(now) + self.session_cache.expire(now)

    # -- pins (cache/pinning.py) ----------------------------------------------------------------

    def pin_prefix(self, pin_id: str, root: BlockHash, token_ids: Sequence[int], ttl_s: float | None = None,
                   tier: str = "device") -> Pin | None:
        return self.pinning.pin_prefix(pin_id, self.hashes(root), token_ids, ttl_s, tier)

    def pin_session(self, pin_id: str, key: SessionKey, ttl_s: float | None = None, tier: str = "device") -> Pin:
        return self.pinning.pin_session(pin_id, key, ttl_s, tier)

    def unpin(self, pin_id: str) -> Pin | None:
        return self.pinning.unpin(pin_id)

    # -- compaction --------------------------------------------------------------------------

    def page_use(self) -> PageUse:
        return page_use(self.pool, self.tables.values(), self.sessions, self.pins)

    def fragmentation(self) -> Fragmentation:
        return measure(self.page_use())

    def plan_compaction(self) -> CompactionPlan:
        """Where each live page goes (cache/compaction.py). Copy `plan.copies` on the device, then
        `apply_compaction(plan)`, with nothing in between: call between two engine steps."""
        self.demote_evicted()  # evicted chunks are saved below from the pages they are in now
        self.reap_stores(None)  # no store may be reading a page while it moves
        return plan_compaction(self.page_use())

    def apply_compaction(self, plan: CompactionPlan) -> None:
        """Renames every page as `plan` says, once its copies were made on the device: one remap, applied by
        every holder of page ids (loads in flight hold pages the plan left where they are)."""
        remap = plan.remap(self.pool.generation)
        for holder in (self.pool, *self.tables.values(), self.sessions, self.pins):
            holder.remap(remap)

    # -- lifetime --------------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """Makes `child_id` share every page of `parent_id` (e.g. for n > 1 samples)."""
        self.tables.fork(parent_id, child_id)

    def retain(self, seq_id: str, retention: Retention) -> None:
        """A soft-retention hint for the pages `seq_id` releases, each time it does, until it is finished."""
        self._retention[seq_id] = retention

    def free(self, seq_id: str, finished: bool = False) -> None:
        """Returns a sequence's pages, and abandons its loads; a no-op for a sequence that holds none.
        `finished`: it will not come back (a preempted one does), so its retention hint goes too."""
        if self.loading is not None:
            self.loading.cancel(seq_id)
            self.loading.forget(seq_id)
        table = self.tables.pop(seq_id)
        retention = self._retention.pop(seq_id, None) if finished else self._retention.get(seq_id)
        if table is not None:
            self.pool.release(table.block_ids, table.high, retention)
