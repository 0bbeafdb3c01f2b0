"""The tier manager: the policy of the tiers below the device. Which tiers a chunk is saved to, in what order
they are asked for a prompt's chunks (`chunk_lookup.py`), what a load counts for, pins and their budgets
(`tier_pins.py`), and the restore plan. The bytes, keys, codecs and writer threads are each tier's backend
(`backend.py`).

    device pages --save--> host slab   every evicted chunk, and idle ones ahead of eviction (the watermark)
                      \\-->  disk        evicted chunks `disk_admission` takes, session turns
                      \\-->  remote      what the disk takes, session turns, and every prompt when shared
    host / disk / remote --load--> fresh device pages, on a transfer worker (`transfer.py`)
    disk / remote --prefetch--> host slab, as soon as a request arrives (`prefetch.py`)

Every value is a kv_frame, host ones too (raw codec): a load compares its
geometry, namespace, block hashes and token ids with the chunk the prompt asks
for, so a hash collision or a damaged value is a miss, never wrong KV. Every
load is timed for the restore planner (`restore_planner.py`), which decides per
request whether loading beats recomputing.

Any tier may be absent (turned off, or it could not open): the manager then
works with the others, and says why in its stats. It is called from the
engine thread, or from the event loop between steps; the writers', the
prefetch and the transfer threads run beside it (`load` runs on the latter).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.host_store import HostStore
from kvtierd.storage.redis_store import RedisStore
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.backend import Admission, PinnableBackend, TierBackend
from kvtierd.tiers.chunk import ChunkCopy, ChunkSpan, FoundChunk
from kvtierd.tiers.chunk_lookup import find_chunks
from kvtierd.tiers.config import TierConfig
from kvtierd.tiers.device_chunk import DeviceChunk
from kvtierd.tiers.open_backends import open_backends
from kvtierd.tiers.page_copy import PageCopier
from kvtierd.tiers.prefetch import Prefetcher
from kvtierd.tiers.restore_planner import RestorePlanner
from kvtierd.tiers.store_name import disk_store_name
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_pins import PIN_TIERS, TierPins
from kvtierd.tiers.tier_stats import Reconciliation, TierCounts, TierStats, off_stats
from kvtierd.tiers.transfer import TransferQueue, TransferStats

class TierManager:
    def __init__(self, config: TierConfig, device: DeviceKVPool, model_fingerprint: str = "") -> None:
        self.config = config
        self.chunk_pages = config.chunk_pages
        self._geometry = device.geometry
        self._pages = pages = PageCopier(device)
        self.transfer_stats = TransferStats()  # times and bytes of every load and store, by tier
        self.counts = {tier: TierCounts() for tier in Tier}
        opened = open_backends(config, pages, self.counts, self.transfer_stats, model_fingerprint)
        self.epoch, self._off = opened.epoch, opened.off
        self.host_tier, self.disk_tier, self.remote_tier = opened.host, opened.disk, opened.remote
        # The disk store's name in the SQL chunk catalog (None: no disk, or its id cannot be kept).
        self.store_name = disk_store_name(config.disk_path) if self.disk_tier is not None else None
        # Nearest first: the fastest serves a chunk several hold.
        self._backends: list[TierBackend] = [b for b in (self.host_tier, self.disk_tier, self.remote_tier) if b]
        self._by_tier: dict[Tier, TierBackend] = {b.tier: b for b in self._backends}
        below = {b.tier: b for b in (self.disk_tier, self.remote_tier) if b is not None}
        self._prefetcher = Prefetcher(self.host_tier, below, self.counts, self.lookup) \
            if self.host_tier is not None and below else None
        self.planner = RestorePlanner()
        self.pins = TierPins(self._pinnable, lambda t: self._off.get(t) or self._by_tier[t].failure, self.epoch,
                             self._geometry)
        # Loads run here, off the engine's step: the cache manager submits them and collects them between steps.
        self.transfers = TransferQueue(self.load, self.bytes_per_page, self.transfer_stats)
        # Finished turns' copies out of the device, off the step: one thread, in submission order, yielding to
        # steps like the writers it feeds (their pages stay referenced until then).
        self._store_copier = BACKGROUND_WORK.pool(1, "kvtierd-store-copy", config.store_defer_ms / 1e3)

    # The tiers' stores, for reports and per-tenant shares (None: the tier is off).
    @property
    def host(self) -> HostStore | None:
        return self.host_tier.storage if self.host_tier is not None else None

    @property
    def disk(self) -> DiskStore | None:
        return self.disk_tier.storage if self.disk_tier is not None else None

    @property
    def remote(self) -> RedisStore | None:
        return self.remote_tier.storage if self.remote_tier is not None else None

    @property
    def bytes_per_page(self) -> int:
        return self._geometry.bytes_per_block

    @property
    def has_disk(self) -> bool:
        return self.disk_tier is not None and self.disk_tier.usable()

    @property
    def can_write_through(self) -> bool:
        """A tier that outlives this process (disk) or this host (remote) is there."""
        return self.has_disk or self.remote_tier is not None

    @property
    def shares_every_request(self) -> bool:
        """Finished requests' chunks go to the fleet, not only sessions'."""
        return self.remote_tier is not None and self.config.remote.admission == "all"

    # -- finding and loading -----------------------------------------------------------------

    def lookup(self, namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int],
               start: int) -> list[FoundChunk]:
        """The stored chunks that continue a chain whose first `start` pages are on the device, in order, each
        from the nearest tier that holds it (`chunk_lookup.py`)."""
        tiers = [b for b in self._backends if b.usable()]
        return find_chunks(tiers, self.chunk_pages, self._geometry.block_size, namespace, block_hashes, token_ids,
                           start) if tiers else []

    def load(self, found: FoundChunk, skip: int, block_ids: Sequence[int],
             waited_for: Callable[[], bool] = lambda: True) -> Tier | None:
        """Copies pages `skip`.. of a found chunk into the device pages `block_ids` (on a transfer worker: see
        `transfers`); returns the tier it counts for: where it was found, or where a prefetch for this request
        copied it from. None when the value is gone (evicted since the lookup) or fails its checks. Its time
        teaches the restore planner only if a request still waited for it as it ended (`waited_for`): one
        abandoned at its deadline crawls on beside the recompute that replaced it: timed, a slow fleet's warm-up
        load that missed its deadline set the estimate of the next ones at 24 s (they took 1-1.5 s), and every
        later request recomputed."""
        t0 = time.perf_counter()
        served, host = self._by_tier.get(found.tier), self.host_tier
        if host is not None and served is not host:  # prefetched meanwhile: the nearest copy serves
            if self._prefetcher is not None:
                self._prefetcher.wait_for(found.span.last_hash)
            if host.has(host.key(found.span.last_hash)):
                served = host
        if served is None or not served.load(found.span, skip, block_ids):
            return None
        if waited_for():
            self.planner.observe_load(served.tier, len(block_ids) * self.bytes_per_page, time.perf_counter() - t0)
        # A prefetched copy counts for the tier that had the chunk.
        tier = found.tier if self._prefetcher is None else self._prefetcher.origin(found.span.last_hash, found.tier)
        counts = self.counts[tier]
        counts.hits += 1
        counts.hit_tokens += len(block_ids) * self._geometry.block_size
        return tier

    def read_ahead(self, found: Sequence[FoundChunk]) -> None:
        """Starts reading the values of chunks that a request's loads will ask for later (their tiers that wait
        on round trips: `TierBackend.read_ahead`)."""
        for backend, spans in self._spans_by_backend(found):
            backend.read_ahead(spans)

    def drop_read_ahead(self, found: Sequence[FoundChunk]) -> None:
        """The request whose loads these chunks were for ended first."""
        for backend, spans in self._spans_by_backend(found):
            backend.drop_read_ahead(spans)

    def _spans_by_backend(self, found: Sequence[FoundChunk]) -> list[tuple[TierBackend, list[ChunkSpan]]]:
        return [(b, spans) for b in self._backends if (spans := [f.span for f in found if f.tier == b.tier])]

    def prefetch(self, namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int], start: int) -> None:
        """Starts copying up to the host tier the chunks of a chain (from page `start`) that only the disk or
        the fleet holds, so its request finds them in memory when it is scheduled. Returns at once."""
        if self._prefetcher is not None and (self.has_disk or self.remote_tier is not None):
            self._prefetcher.prefetch(namespace, block_hashes, token_ids, start)

    def warm(self, keys: Sequence[bytes]) -> Future:
        """Copies these disk chunks up to the host tier, the last ones most recent (`Prefetcher.warm`): the
        chunks of recently active sessions, so their next turns start from memory."""
        if self._prefetcher is None or not self.has_disk:
            done: Future = Future()
            done.set_result(0)
            return done
        return self._prefetcher.warm(self.disk_tier, keys)

    # -- saving --------------------------------------------------------------------------------

    def demote(self, copies: Sequence[ChunkCopy]) -> None:
        """Saves chunks of pages evicted from the device: each to the host tier, and to disk and the
        fleet those the disk admission policy takes. Call before the pages are written again; returns
        once they may be."""
        take_all = self.config.disk_admission == "all"
        self._save(copies, lambda b, c: b is self.host_tier or take_all or c.hits > 0)

    def save_ahead(self, copies: Sequence[ChunkCopy]) -> int:
        """Saves chunks of idle device pages to the host tier before they are evicted (the free-page
        watermark); their eviction then finds them saved. Returns how many were not there yet."""
        before = self.counts[Tier.HOST].writes
        self._save(copies, lambda b, c: b is self.host_tier)
        return self.counts[Tier.HOST].writes - before

    def write_turn(self, copies: Sequence[ChunkCopy], session: bool,
                   copied: list[Future] | None = None) -> tuple[bytes, ...]:
        """Saves a finished request's chunks: a session's turn to disk and the fleet, so the session outlives a
        restart, a crash or its host; any other request's prompt to the fleet, when it shares every request.
        The copy out of the device happens now; encoding and storing on the writers' threads (a chunk the
        disk writer has no room for is dropped and counted).

        Returns the disk keys of a session turn's chunks (stored, or queued now and marked cataloged) for the
        SQL catalog to name; the startup reconciliation (`reconcile`) settles what a crash left half done.

        Given `copied`, the copy out of the device is not made now but on the store-copy thread: a future per
        chunk copied goes to `copied`, and the caller keeps the chunks' pages referenced until each is done
        (nothing may write into them before)."""
        to_remote = session or self.shares_every_request
        _, disk_keys = self._save(copies, lambda b, c: b is self.disk_tier and session or
                                  b is self.remote_tier and to_remote, cataloged=True, copied=copied)
        return tuple(disk_keys)

    def write_through(self, copies: Sequence[ChunkCopy]) -> bool:
        """Queues chunks for the disk tier and the fleet (the shutdown flush), as many as the disk writer's
        queue has room for: False when it filled up first; then `wait()` (off the event loop) and call again.
        Chunks stored or queued already are skipped."""
        done, _ = self._save(copies, lambda b, c: b is not self.host_tier, wait_for_disk=True)
        return done

    def _save(self, copies: Sequence[ChunkCopy], admitted: Callable[[TierBackend, ChunkCopy], bool],
              wait_for_disk: bool = False, cataloged: bool = False,
              copied: list[Future] | None = None) -> tuple[bool, list[bytes]]:
        """Offers each copy to the tiers `admitted` sends it to. Returns whether every copy was taken (False
        only with `wait_for_disk`: the disk was full), and the disk keys of the copies it has or will have."""
        disk_keys = []
        for c in copies:
            nbytes = len(c.block_ids) * self.bytes_per_page
            taking = []
            for b in self._backends:
                if not admitted(b, c):
                    continue
                wait = wait_for_disk and b is self.disk_tier
                admission = b.admit(c.span.last_hash, nbytes, drop=not wait)
                if admission is Admission.FULL and wait:
                    return False, disk_keys
                if b is self.disk_tier and admission in (Admission.HELD, Admission.TAKE):
                    disk_keys.append(b.key(c.span.last_hash))
                if admission is Admission.TAKE:
                    taking.append(b)
            if taking:
                chunk = DeviceChunk(self._pages, c.block_ids, self._store_copier, copied)
                identity = c.span.identity(self._geometry)
                for b in taking:
                    b.store(c.span.last_hash, identity, chunk, cataloged)
        return True, disk_keys

    def _pinnable(self, tier: Tier) -> PinnableBackend | None:
        backend = self._by_tier.get(tier) if tier in PIN_TIERS else None
        return backend if backend is not None and backend.usable() else None

    # -- forgetting ----------------------------------------------------------------------------

    def forget(self, block_hashes: Sequence[bytes]) -> None:
        """Drops the chunks keyed by these pages' hashes (a session's own pages: every chunk of its chain
        past them is keyed by one of them)."""
        if block_hashes:
            for b in self._backends:
                b.delete(block_hashes)

    def invalidate_all(self) -> None:
        """Makes everything stored so far unreachable (a new epoch, here and in the fleet); the LRU
        reclaims its room."""
        self.epoch.renew()
        self.pins.empty_all()  # their chunks are unreachable now: let the LRU have them
        for b in self._backends:
            b.invalidate()

    def reconcile(self, cataloged: set[bytes]) -> Reconciliation | None:
        """Settles the disk tier against the keys the SQL catalog names (`cataloged`): deletes the values a
        session's turn wrote that it no longer names (their session was deleted meanwhile, or the daemon died
        before the turn was stored), and returns the cataloged keys the disk lacks, whose rows are to go.
        None without a disk tier. Runs on the disk writer's thread, after the writes queued before it."""
        return self.disk_tier.reconcile(cataloged) if self.has_disk else None

    # -- lifetime and reports ------------------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until the prefetches and writes queued so far are done (never call it on the event loop)."""
        if self._prefetcher is not None:
            self._prefetcher.wait()
        for b in self._backends:
            b.wait()

    def close(self) -> None:
        self.transfers.close()
        self._store_copier.shutdown(wait=True)
        if self._prefetcher is not None:
            self._prefetcher.close()
        for b in self._backends:
            b.close()

    def stats(self) -> list[TierStats]:
        """One row per tier: host and disk always (off ones say why), the fleet's when one is configured."""
        return [self._by_tier[t].stats() if t in self._by_tier else off_stats(t, self._off[t], self.counts[t])
                for t in Tier if t in self._by_tier or t in self._off]
