"""The KV tiers' background work (loads, stores, prefetches): counted so a step can leave it a core, and stores
yielding to steps.

Each worker pool of the tiers is a `BACKGROUND_WORK.pool`. Their work is
mostly outside the GIL (zstd, hashing, memcpy, LMDB, sockets), so it runs
beside a step on another core; the engine reads `busy` before each step
(engine/step_threads.py). A task counts from its submission until it ends (or
is cancelled). Lookups are not counted: they wait on a store far more than
they compute; a prefetch counts only while it copies a chunk up (`counted`).
One count for the process, as its cores and torch's threads are the
process's.

Stores are on no request's path, so the pools given a `defer_s` (the lower
tiers' writers, and the store-copy thread that feeds them a finished turn's
pages) yield to steps: each of their tasks waits while an engine has
steps to run (`engine_has_steps`) and starts once every engine has been idle
for IDLE_SPELL_S, or `defer_s` after its submission at the latest, so a
daemon that never pauses still stores, later. Such a task counts only once it
starts: waiting, it takes no core, and the step keeps all its threads.
Shutting a pool down, or `hurry` (a caller about to wait for them), lets
the waiting tasks start at once. Loads and prefetches never wait: a request
waits for them.

Loads are paced instead (`pool(..., paced=True)`): they do not count, so a
step keeps every thread. While an engine computes for running requests, the
loads run one at a time (a chunk each turn), and each sleeps between slices
of its work (`pace`, called between a chunk's layers) so that together they
take about PACED_SHARE (a seventh) of one core. Counted, a load made the steps
run at one thread for its 100-200 ms, and two loads side by side took both cores: the
streams' steps ran 1.5-4x their time (`kvtierd bench stall`, 2 cores). Paced,
a load takes longer and only its own request waits for it. A load whose
work cannot yield (a fleet value's GET, HMAC and decode, in one piece) is
counted instead, from its submission (`count_until_done`), and does not
pace; still one at a time. For an engine that computes nothing
else (a lone restore) loads run at full speed, side by side.

Work a request waits for (a fleet load, a prefetch's copy) is `awaited`:
a step always leaves it a core. Stores are not: a step the engine predicts
long keeps every thread beside them (engine/step_threads.py), and a store
waiting on its store (a chunk's SET or LMDB put: `waiting`) stops counting
once that wait has lasted COUNTED_WAIT_S, until it ends. A slow Redis held
such waits 300 ms a call while the steps ran at one thread beside them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import torch

# How long the engines stay idle before deferred tasks start. A started chunk is not stopped for a step, and the
# gap between one request's end and the next one's steps (a chat's next turn sent on the reply, a busy
# daemon's next request) is shorter than this; an idle spell worth the name is longer.
IDLE_SPELL_S = 0.1
# The share of one core paced loads take together while an engine computes for running requests. Any work beside
# a step costs it more than its share: a thread paced at 30% of a core, copying or hashing alike, took three
# decoding streams' steps from 16-18 ms to 26-30 (probe, 2 cores), a step's threads waiting for the one that
# lost its core. Measured with `bench stall` (Zen 5, 2 cores; the streams' ITL p99 during a disk load over
# without it): 0.35 gave 1.46x at a TTFT of 648 ms, 0.5 2.43x (667 ms); counted loads, 3.39x (548 ms). Once the
# join step (a long context's first token beside the streams) was no longer most of the window (the decode
# kernel's touch pass; a Xeon with AMX, 2 cores), 0.15 gave 1.25-1.66x over six runs (median 1.48; TTFT 503-635
# ms, 3.5x faster than recomputing), 0.2 1.57x (446 ms), 0.35 1.56x and 1.58x (387 and 328 ms): the run-to-run
# spread is as wide as the gain. A disk load's ~40 ms of CPU spreads over ~600 ms; its own request waits longer
# (a lone restore, not paced, does not).
PACED_SHARE = 0.15
# A store's wait on its store counts this long, then no more until it ends: a SET or a put on this host takes a
# few ms of the store's own CPU, and one through a slow network holds no core.
COUNTED_WAIT_S = 0.02


def single_threaded() -> None:
    """The tiers' worker pools' initializer: torch ops on a worker run on it alone (OpenMP's thread count is per
    thread), so only the step thread keeps a team of OpenMP workers (kernels/torch_threads.py says why)."""
    torch.set_num_threads(1)


class BackgroundWork:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gate = threading.Condition(self._lock)  # notified when the engines go idle or a pool shuts down
        self._pending = 0  # tasks counted and not ended
        self._awaited = 0  # of them, work a request waits for (`counted`, `count_until_done`)
        self._deferred = 0  # tasks waiting for the engines' idle spells
        self._engines_with_steps = 0
        self._engines_computing = 0  # engines with running requests: paced tasks slow down for them
        self._paced_until = float("-inf")  # monotonic: paced tasks sleep until then after their last slice
        self._paced = threading.local()  # on a paced task's thread: `.cpu_mark`, its CPU time at its last pace
        self._paced_turn = threading.Lock()  # paced tasks run one at a time while an engine computes
        self._idle_since = float("-inf")  # monotonic time the engines last went idle
        self._task = threading.local()  # `.store` True on a thread running a counted store's task
        self._waits: dict[int, float] = {}  # thread id -> monotonic start of its wait on a store (counted tasks)
        self._hurried_at = float("-inf")  # deferred tasks submitted before this monotonic time start now

    @property
    def awaited(self) -> bool:
        """Work a request waits for is pending (a fleet load, a prefetch's copy up)."""
        return self._awaited > 0

    @property
    def busy(self) -> bool:
        """Counted work is pending, but for stores that have waited on their store COUNTED_WAIT_S."""
        if not self._waits:
            return self._pending > 0
        with self._lock:
            now = time.monotonic()
            return self._pending > sum(now - since >= COUNTED_WAIT_S for since in self._waits.values())

    @property
    def num_deferred(self) -> int:
        """Tasks waiting now for an idle spell of the engines (not counted in `busy`)."""
        return self._deferred

    def engine_has_steps(self, has: bool) -> None:
        """An engine now has steps to run (True) or none left (False): called by each engine on each change,
        and with False when it stops."""
        with self._lock:
            self._engines_with_steps += 1 if has else -1
            assert self._engines_with_steps >= 0, "an engine went idle twice"
            if not self._engines_with_steps:
                self._idle_since = time.monotonic()
                self._gate.notify_all()

    def engine_computes(self, computes: bool) -> None:
        """An engine now has running requests (True) or none (False): paced tasks yield to it meanwhile.
        Called by each engine on each change, and with False when it stops."""
        with self._lock:
            self._engines_computing += 1 if computes else -1
            assert self._engines_computing >= 0, "an engine stopped computing twice"
            if not self._engines_computing:
                self._gate.notify_all()

    def pace_until(self, until: float | None) -> None:
        """The paced task on this thread sleeps no more once monotonic `until` has passed (None: no bound): a
        load must arrive well within its deadline, or its request recomputes."""
        self._paced.until = until

    def pace(self) -> None:
        """Called by a paced task between slices of its work: while an engine computes, sleeps so that paced
        tasks together use about PACED_SHARE of a core (the CPU time of its slice, times what that leaves to
        the steps), up to its `pace_until`. Anywhere else (the step thread, a tool) it does nothing."""
        mark = getattr(self._paced, "cpu_mark", None)
        if mark is None:
            return
        used = time.thread_time() - mark
        until = self._paced.until
        with self._lock:
            now = time.monotonic()
            if self._yields(until, now):
                self._paced_until = max(self._paced_until, now) + used * (1 / PACED_SHARE - 1)
                wake = self._paced_until if until is None else min(self._paced_until, until)
                while self._engines_computing and (now := time.monotonic()) < wake:
                    self._gate.wait(wake - now)
        self._paced.cpu_mark = time.thread_time()

    def pacing(self) -> bool:
        """Whether the paced task on this thread yields now (`pace` would sleep): its work goes in slices then,
        and in one piece otherwise."""
        if getattr(self._paced, "cpu_mark", None) is None:
            return False
        return self._yields(self._paced.until, time.monotonic())

    def _yields(self, until: float | None, now: float) -> bool:
        """A paced task bound by `until` yields at monotonic `now`: an engine computes, and its bound is ahead."""
        return bool(self._engines_computing) and (until is None or now < until)

    def hurry(self) -> None:
        """Lets every deferred task submitted so far start now: for a caller about to wait for one between
        steps, which would otherwise wait out its deferral."""
        with self._lock:
            self._hurried_at = time.monotonic()
            self._gate.notify_all()

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Counts what runs inside it: for a thread whose work only sometimes computes (a prefetch computes
        only once its lookup found something to copy up). It is work a request waits for (`awaited`)."""
        self._add(1, awaited=True)
        try:
            yield
        finally:
            self._add(-1, awaited=True)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a store task's wait on its store: it stops counting once it has waited COUNTED_WAIT_S, until the
        wait ends. Elsewhere (an uncounted task, the step thread) it does nothing."""
        if not getattr(self._task, "store", False):
            yield
            return
        me = threading.get_ident()
        with self._lock:
            self._waits[me] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                del self._waits[me]

    def count_until_done(self, future: Future) -> None:
        """Counts a submitted task from now until it ends (or is cancelled): a paced pool's task that cannot
        yield, counted from its submission so that no step starts at every thread just before it runs."""
        self._add(1, awaited=True)
        future.add_done_callback(lambda _: self._add(-1, awaited=True))

    def pool(self, max_workers: int, thread_name_prefix: str, defer_s: float = 0.0,
             paced: bool = False) -> ThreadPoolExecutor:
        """A worker pool whose tasks count; with `defer_s` > 0, each yields to steps for up to that long;
        `paced`, its tasks do not count and are paced (`pace`) while an engine computes."""
        if paced:
            return _PacedPool(self, max_workers, thread_name_prefix)
        if defer_s > 0:
            return _DeferringPool(self, max_workers, thread_name_prefix, defer_s)
        return _CountedPool(self, max_workers, thread_name_prefix)

    def _add(self, n: int, awaited: bool = False) -> None:
        with self._lock:
            self._pending += n
            if awaited:
                self._awaited += n

    @contextmanager
    def _store_thread(self) -> Iterator[None]:
        """Marks what runs inside it as a counted store's work, for `waiting`."""
        self._task.store = True
        try:
            yield
        finally:
            self._task.store = False

    def _start_deferred(self, submitted: float, deadline: float, shut: Callable[[], bool]) -> None:
        """Waits until the engines have been idle for IDLE_SPELL_S, the monotonic `deadline`, `shut()` or a
        `hurry` after its `submitted` time; then counts the task that called it."""
        with self._lock:
            self._deferred += 1
            while not shut() and submitted > self._hurried_at and (now := time.monotonic()) < deadline:
                if self._engines_with_steps:
                    self._gate.wait(deadline - now)
                elif now < (idle_enough := self._idle_since + IDLE_SPELL_S):
                    self._gate.wait(min(idle_enough, deadline) - now)
                else:
                    break
            self._deferred -= 1
            self._pending += 1

    def _shut(self) -> None:
        with self._lock:
            self._gate.notify_all()


class _CountedPool(ThreadPoolExecutor):
    def __init__(self, work: BackgroundWork, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=single_threaded)
        self._work = work

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        self._work._add(1)
        try:
            future = super().submit(self._as_store, fn, args, kwargs)
        except BaseException:  # shut down: nothing was queued
            self._work._add(-1)
            raise
        future.add_done_callback(lambda _: self._work._add(-1))  # run on cancellation too
        return future

    def _as_store(self, fn: Callable, args: tuple, kwargs: dict) -> object:
        with self._work._store_thread():
            return fn(*args, **kwargs)


class _PacedPool(ThreadPoolExecutor):
    def __init__(self, work: BackgroundWork, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=single_threaded)
        self._work = work

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        return super().submit(self._paced, fn, args, kwargs)

    def _paced(self, fn: Callable, args: tuple, kwargs: dict) -> object:
        work = self._work
        with work._paced_turn if work._engines_computing else nullcontext():
            work._paced.cpu_mark, work._paced.until = time.thread_time(), None
            try:
                return fn(*args, **kwargs)
            finally:
                work._paced.cpu_mark = None


class _DeferringPool(ThreadPoolExecutor):
    """Its tasks start when the engines are idle or `defer_s` after their submission, and count from then."""

    def __init__(self, work: BackgroundWork, max_workers: int, thread_name_prefix: str, defer_s: float) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=single_threaded)
        self._work = work
        self._defer_s = defer_s
        self._shutting = False

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        now = time.monotonic()  # a cancelled task never counted
        return super().submit(self._deferred, now, now + self._defer_s, fn, args, kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutting = True  # what waits starts now: closing never waits for the engines (`_shut` wakes it)
        self._work._shut()
        super().shutdown(wait, cancel_futures=cancel_futures)

    def _deferred(self, submitted: float, deadline: float, fn: Callable, args: tuple, kwargs: dict) -> object:
        self._work._start_deferred(submitted, deadline, lambda: self._shutting)
        try:
            with self._work._store_thread():
                return fn(*args, **kwargs)
        finally:
            self._work._add(-1)


BACKGROUND_WORK = BackgroundWork()
