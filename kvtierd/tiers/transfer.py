"""Chunk loads in flight: lower tier -> device pages, on worker threads, never on the engine's step.

    engine thread                          transfer worker
    -------------                          ---------------
    submit(chunk, pages)  ----queued---->  read the store, check the frame,
    (the pages are held by the load)       copy into the pages
    ... steps go on ...
    done(load) / wait()   <---finished---  (the future is set)

Lookups (which chunks the lower tiers hold: a host probe, an LMDB read on the
disk writer's thread, a Redis EXISTS) run here too, on threads of their own
(`look_up`), so a slow or dead Redis never holds a step, and a lookup never
queues behind another request's loads.

A load is keyed by its chunk's last hash and the pages it skips: a second
request needing the same chunk joins the load under way (`find` + `join`)
instead of reading it again. A load has waiters (request ids); when the last
one leaves before the load finished (the request was cancelled, or gave up at
its deadline and recomputes), the load is abandoned: one still queued is
cancelled and its pages go back at once; one under way stops where its next
slice would start (background_work.py's TaskAbandoned: a slow Redis's late
value is neither checked, decoded nor copied) and keeps its pages until then
(`reap`), so nothing else is written into them meanwhile. The
caller owns the pages' references: this table only says when they may go.

The workers are paced (tiers/background_work.py): while the engine computes
for running requests, loads take turns, a chunk each, and work in slices
(a group of layers' copy, a MiB of hashing or decoding) only between its
steps, within the time the engine lends them.

Transfer times are recorded per tier and direction (`TransferStats`): loads
here, stores by the tier manager (host) and the writers (disk, remote).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvtierd.tiers.background_work import BACKGROUND_WORK, init_worker_thread
from kvtierd.tiers.chunk import FoundChunk
from kvtierd.tiers.tier import Tier

# Two loads of different chunks run side by side (or, paced, take turns a chunk each): one request never waits
# behind another's whole load.
TRANSFER_WORKERS = 2
LOOKUP_WORKERS = 2  # lookups of two requests run side by side: one stuck on a dead Redis does not hold the other
# Upper bounds (seconds) of the transfer-time histogram's buckets.
TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(eq=False, slots=True)
class ChunkLoad:
    found: FoundChunk
    skip: int  # pages of the chunk the device already had: not loaded
    block_ids: tuple[int, ...]  # the device pages it fills (held for it until it ends)
    high: bool  # the class the pages were taken for (they are released for it)
    future: Future  # its result: the Tier it counts for, or None (gone from its tier, or a failed check)
    waiters: set[str] = field(default_factory=set)

    @property
    def key(self) -> tuple[bytes, int]:
        return self.found.span.last_hash, self.skip

    @property
    def done(self) -> bool:
        return self.future.done()

    def tier(self) -> Tier | None:
        """What a finished load returned: its tier, or None when it failed or was cancelled."""
        try:
            return self.future.result(timeout=0)
        except (CancelledError, Exception):  # a failed load is a miss: its tokens are recomputed
            return None


@dataclass(slots=True)
class TransferHistogram:
    """Durations of one tier's transfers in one direction, cumulative Prometheus-style."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(TRANSFER_BUCKETS_S))
    count: int = 0
    sum_s: float = 0.0
    nbytes: int = 0

    def observe(self, seconds: float, nbytes: int) -> None:
        for i, bound in enumerate(TRANSFER_BUCKETS_S):
            if seconds <= bound:
                self.bucket_counts[i] += 1
        self.count += 1
        self.sum_s += seconds
        self.nbytes += nbytes


class TransferStats:
    """Transfer times and bytes by (tier, direction); written by workers, read by reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[tuple[str, str], TransferHistogram] = {}
        self.loads_past_deadline = 0  # lookups or loads a request stopped waiting for (or never waited): it recomputed

    def observe(self, tier: str, direction: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._by.setdefault((tier, direction), TransferHistogram()).observe(seconds, nbytes)

    def snapshot(self) -> dict[tuple[str, str], TransferHistogram]:
        with self._lock:
            return {k: TransferHistogram(list(h.bucket_counts), h.count, h.sum_s, h.nbytes) for k, h in self._by.items()}


class TransferQueue:
    """The loads in flight and the worker threads that run them."""

    def __init__(self, load: Callable[[FoundChunk, int, Sequence[int], Callable[[], bool]], Tier | None],
                 bytes_per_page: int, stats: TransferStats, workers: int = TRANSFER_WORKERS) -> None:
        """`load(found, skip, block_ids, waited_for)`: `waited_for()` tells whether a request still waits for it."""
        self._load = load
        self._bytes_per_page = bytes_per_page
        self.num_workers = workers
        self._pool = BACKGROUND_WORK.paced_pool(workers, "kvtierd-transfer")
        self._lookup_pool = ThreadPoolExecutor(max_workers=LOOKUP_WORKERS, thread_name_prefix="kvtierd-lookup",
                                               initializer=init_worker_thread)
        _start_threads(self._pool, workers)
        _start_threads(self._lookup_pool, LOOKUP_WORKERS)
        self._lookups = 0  # lookups not finished yet (under `_finished`)
        self._in_flight: dict[tuple[bytes, int], ChunkLoad] = {}  # loads with waiters, until they leave
        self._abandoned: list[ChunkLoad] = []  # nobody waits; their pages go once they finish
        self._finished = threading.Condition()
        self.stats = stats
        # How long lookups take to answer lately (an average weighting the latest half; None: none answered yet).
        self.lookup_s: float | None = None

    @property
    def num_in_flight(self) -> int:
        """Loads queued or running, abandoned ones included."""
        return sum(not load.done for load in (*self._in_flight.values(), *self._abandoned))

    def find(self, found: FoundChunk, skip: int) -> ChunkLoad | None:
        """The load of this chunk (the same pages of it) under way, to join instead of loading it again."""
        return self._in_flight.get((found.span.last_hash, skip))

    def submit(self, waiter: str, found: FoundChunk, skip: int, block_ids: Sequence[int], high: bool,
               pace_until: float | None = None) -> ChunkLoad:
        load = ChunkLoad(found, skip, tuple(block_ids), high, Future(), {waiter})
        load.future = self._pool.submit_paced(pace_until, self._run, load, unwanted=lambda: not load.waiters)
        load.future.add_done_callback(self._notify)
        self._in_flight[load.key] = load
        return load

    def join(self, load: ChunkLoad, waiter: str) -> None:
        load.waiters.add(waiter)

    def leave(self, load: ChunkLoad, waiter: str) -> bool:
        """`waiter` no longer waits for `load`. True when its pages may be released now (nobody else waits
        and it is finished or was still queued); an unfinished one is abandoned, for `reap` to give back."""
        load.waiters.discard(waiter)
        if load.waiters:
            return False
        if self._in_flight.get(load.key) is load:
            del self._in_flight[load.key]
        if load.done or load.future.cancel():
            return True
        self._abandoned.append(load)
        return False

    def reap(self) -> list[ChunkLoad]:
        """Abandoned loads that have finished since: their pages are nobody's now."""
        done = [load for load in self._abandoned if load.done]
        if done:
            self._abandoned = [load for load in self._abandoned if not load.done]
        return done

    @property
    def num_lookups(self) -> int:
        """Lookups queued or running."""
        with self._finished:
            return self._lookups

    def look_up(self, fn: Callable[[], list[FoundChunk]]) -> Future:
        """Runs a lookup of the lower tiers on a lookup worker; its future holds the chunks found."""
        with self._finished:
            self._lookups += 1
        future = self._lookup_pool.submit(self._timed_lookup, fn)
        future.add_done_callback(self._lookup_done)
        return future

    def _timed_lookup(self, fn: Callable[[], list[FoundChunk]]) -> list[FoundChunk]:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            took = time.perf_counter() - t0
            self.lookup_s = took if self.lookup_s is None else (self.lookup_s + took) / 2

    def wait_lookups(self) -> None:
        """Blocks until every lookup submitted so far has finished (tools and tests)."""
        with self._finished:
            self._finished.wait_for(lambda: self._lookups == 0)

    def run(self, fn: Callable[[], object]) -> Future:
        """Runs `fn` on a transfer worker (a barrier behind the loads queued before it)."""
        return self._pool.submit(fn)

    def wait(self, timeout_s: float, ready: Callable[[], bool]) -> None:
        """Blocks until `ready()` (checked first, and as each load or lookup finishes) or `timeout_s` passes:
        the engine, with nothing to compute but its waiters."""
        with self._finished:
            self._finished.wait_for(ready, timeout_s)

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, load: ChunkLoad) -> Tier | None:
        t0 = time.perf_counter()
        tier = self._load(load.found, load.skip, load.block_ids, lambda: bool(load.waiters))
        if tier is not None:
            self.stats.observe(load.found.tier, "load", time.perf_counter() - t0,
                               len(load.block_ids) * self._bytes_per_page)
        return tier

    def _lookup_done(self, _: Future) -> None:
        with self._finished:
            self._lookups -= 1
            self._finished.notify_all()

    def _notify(self, _: Future) -> None:
        with self._finished:
            self._finished.notify_all()


def _start_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Starts the pool's `n` threads now. A pool starts them as work arrives, and the step that submitted the
    first load paid for it: ~8 ms of the step thread waiting for them to start (py-spy, 2 cores)."""
    started = threading.Barrier(n)
    for task in [pool.submit(started.wait, 60) for _ in range(n)]:
        task.result()
