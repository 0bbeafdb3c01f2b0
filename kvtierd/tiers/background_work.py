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

Loads are paced instead (`paced_pool`): they do not count, so a step keeps
every thread, and while an engine computes for running requests they never
run beside its forward. Once a step is scheduled, the engine lends the loads
LEND_SHARE of the step's predicted time (`lend`) and waits meanwhile; a load
works in slices (a group of layers' copy, a MiB of hashing or decoding, one
read), calling `pace` between them, and starts a slice only while a lend has
room for it. A wait that takes no core (a direct read from disk; a Redis
round trip, mostly the server's and the wire's time) is no slice
(`unsliced`): it goes on beside the steps, and another load takes the turn
meanwhile.
The streams' gaps grow by that share and no more: work that ran beside a
step cost it far more than its own time, the step's threads waiting for
the one that lost its core (loads paced at a seventh of a core beside the
steps: 1.25-1.66x the streams' ITL p99 in `bench stall`'s disk scenario;
counted, a load made the steps run at one thread: 1.5-4x). While an engine
computes, loads run one at a time (a chunk each turn); past its bound (a
share of its request's deadline) a load runs in one piece beside the
steps, and for an engine that computes nothing else (a lone restore) loads
run at full speed, side by side. A paced task whose result nobody wants any
more (`unwanted`, given at submission: a load whose requests left, cancelled
or past their deadline) stops at its next slice: `pace` raises TaskAbandoned
there, so it no longer takes lends nor holds its pages to the end.

Work a request waits for (a prefetch's copy) is `awaited`: a step always
leaves it a core. Stores are not: a step the engine predicts
long keeps every thread beside them (engine/step_threads.py), and a store
waiting on its store (a chunk's SET or LMDB put: `waiting`) stops counting
once that wait has lasted COUNTED_WAIT_S, until it ends. A slow Redis held
such waits 300 ms a call while the steps ran at one thread beside them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

# How long the engines stay idle before deferred tasks start. A started chunk is not stopped for a step, and the
# gap between one request's end and the next one's steps (a chat's next turn sent on the reply, a busy
# daemon's next request) is shorter than this; an idle spell worth the name is longer.
IDLE_SPELL_S = 0.1
# The share of a step's predicted time an engine that computes lends to paced loads before each forward (`lend`): a
# stream's inter-token gap grows by about this much while a load runs. Work beside a step costs it more than its own
# time: a thread paced at 30% of a core, copying or hashing alike, took three decoding streams' steps from 16-18 ms
# to 26-30 (probe, 2 cores), the step's threads waiting for the one that lost its core; loads that ran beside the
# steps at a seventh of a core gave 1.25-1.66x the streams' ITL p99 in `bench stall`'s disk scenario. Lent, a
# load's window holds steps of their own length plus the lend (`bench stall`, 2 cores: 0.2 and 0.3 gave the same
# TTFTs, the slices' own length and the room rule setting the pace more than the share).
LEND_SHARE = 0.3
# A lending step waits this long at most for a slice that runs as its lend ends (a slice is one layer's copy, one
# read of a value): a bound, so that a slice stuck on something (a disk that stopped answering) never holds it.
SLICE_WAIT_S = 0.05
# A store's wait on its store counts this long, then no more until it ends: a SET or a put on this host takes a
# few ms of the store's own CPU, and one through a slow network holds no core.
COUNTED_WAIT_S = 0.02


class TaskAbandoned(Exception):
    """Raised in a paced task, where its next slice would start, once nobody wants its result (`unwanted`)."""


def init_worker_thread() -> None:
    """The tiers' worker pools' initializer: torch ops on a worker run on it alone (OpenMP's thread count is per
    thread), so only the step thread keeps a team of OpenMP workers (kernels/torch_threads.py says why); and a
    worker runs on any core the process may use, the main thread's, not on the one core of the step thread
    that started it (a thread inherits its creator's affinity: kernels/thread_pinning.py)."""
    torch.set_num_threads(1)
    os.sched_setaffinity(0, os.sched_getaffinity(os.getpid()))


class BackgroundWork:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gate = threading.Condition(self._lock)  # notified when the engines go idle or a pool shuts down
        self._pending = 0  # tasks counted and not ended
        self._awaited = 0  # of them, work a request waits for (`counted`)
        self._deferred = 0  # tasks waiting for the engines' idle spells
        self._engines_with_steps = 0
        self._engines_computing = 0  # engines with running requests: paced tasks run within their lends
        # On a paced task's thread: `.until`, its bound (None: none; False: not a paced task); `.turn`, the turn it
        # holds (None: it runs beside others); `.unwanted`, its submitter's test (None: none); `.slicing`; `.first`,
        # whether its slice is its task's first; `.began`, when it began; `.first_s` and `.last_s`, how long the
        # thread's last first slice and last later slice took.
        self._paced = threading.local()
        self._paced_turn = threading.Lock()  # paced tasks run one at a time while an engine computes
        self._lent_until = float("-inf")  # monotonic: paced tasks may start slices until then (`lend`)
        self._paced_queued = 0  # paced tasks submitted that have not asked for their first slice yet
        self._paced_asking = 0  # paced tasks waiting for a lend to start a slice
        self._slicing = 0  # paced tasks inside a slice they waited for: the lending step waits for it to end
        self._lend_sliced = False  # a slice started in the open lend
        self._lend_declined = False  # a paced task's next slice would not fit in the open lend: it ends
        self._idle_since = float("-inf")  # monotonic time the engines last went idle
        self._task = threading.local()  # `.store` True on a thread running a counted store's task
        self._waits: dict[int, float] = {}  # thread id -> monotonic start of its wait on a store (counted tasks)
        self._hurried_at = float("-inf")  # deferred tasks submitted before this monotonic time start now

    @property
    def awaited(self) -> bool:
        """Work a request waits for is pending (a prefetch's copy up)."""
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

    def pace(self) -> None:
        """Called by a paced task between slices of its work: while an engine computes, its slice ends, and the
        next one starts within a lend (at once if the lend is still open), up to its bound. Raises
        TaskAbandoned instead of going on when its result is unwanted now. Anywhere else (the step thread, a
        tool) it does nothing."""
        if getattr(self._paced, "until", False) is False:
            return
        with self._lock:
            self._end_slice()
            self._begin_slice()
        self._check_wanted()

    def _check_wanted(self) -> None:
        unwanted = self._paced.unwanted
        if unwanted is not None and unwanted():
            raise TaskAbandoned

    @contextmanager
    def unsliced(self) -> Iterator[None]:
        """Around a paced task's wait that takes no core (a direct read from disk: the disk writes the pages,
        no thread copies them; a Redis round trip): its slice ends before the wait, which goes on beside the
        steps with the turn passed on (another load's slices, or its own wait, run meanwhile), and its next slice
        starts after it, with the turn back, within a lend, as the task's first (what its read brought is first
        used then). Elsewhere, or in a task that runs in one piece, it does nothing."""
        if not getattr(self._paced, "slicing", False):
            yield
            return
        turn = self._paced.turn
        with self._lock:
            self._end_slice(timed=False)  # a part slice, not what its kind takes
        if turn is not None:
            turn.release()  # another task's slices run meanwhile: two loads wait on their reads side by side
        try:
            yield
        finally:
            if turn is not None:
                turn.acquire()
            with self._lock:
                self._begin_slice(first=True)

    def pacing(self) -> bool:
        """Whether the paced task on this thread yields now (`pace` would wait for a lend): its work goes in
        slices then, and in one piece otherwise."""
        until = getattr(self._paced, "until", False)
        return until is not False and self._yields(until, time.monotonic())

    @property
    def computing(self) -> bool:
        """An engine has running requests: their steps are what background work must not stall."""
        return self._engines_computing > 0

    @property
    def wants_lend(self) -> bool:
        """Paced tasks are queued or asking for a slice while an engine computes: a `lend` would run them."""
        return bool((self._paced_queued or self._paced_asking) and self._engines_computing)

    def lend(self, seconds: float) -> None:
        """On the step thread of an engine that computes, before a forward: paced tasks run slices of their
        work for up to `seconds` while this thread waits. Returns at once when none is queued or asking for a
        slice, and early once none is left or the next would not fit (`_begin_slice`). A slice running as the
        lend ends is waited for, SLICE_WAIT_S at most."""
        with self._lock:
            if seconds <= 0 or not self.wants_lend:
                return
            self._lent_until = end = time.monotonic() + seconds
            self._lend_sliced = self._lend_declined = False
            self._gate.notify_all()
            while (now := time.monotonic()) < end:
                if not self._slicing and (self._lend_declined or not (self._paced_queued or self._paced_asking)):
                    break
                self._gate.wait(end - now)
            self._lent_until = float("-inf")
            end = time.monotonic() + SLICE_WAIT_S
            while self._slicing and (now := time.monotonic()) < end:
                self._gate.wait(end - now)

    def _begin_slice(self, first: bool = False) -> None:
        """Under the lock, on a paced task's thread: while it yields, waits for a lend with room for its next
        slice, and then counts as slicing (the lend waits for its slice to end). A slice is expected to take as
        long as the thread's last one of its kind: a task's `first` (its read: a GET, a disk value) or a later
        one (a group of layers' copy, a MiB of work); the lend's first slice always has room. A slice that would not fit
        ends the lend: started, it would hold the step past it (a GET started at a lend's end held it 3-5 ms)."""
        until = self._paced.until
        self._paced.first = first
        self._paced_asking += 1
        while self._yields(until, now := time.monotonic()) and not self._fits(now):
            if now < self._lent_until:
                self._lend_declined = True
            self._gate.notify_all()  # the lend ends early: nothing more to run in it
            self._gate.wait(None if until is None else until - now)
        self._paced_asking -= 1
        self._paced.slicing = self._yields(until, now := time.monotonic())
        self._slicing += self._paced.slicing
        self._lend_sliced |= self._paced.slicing
        self._paced.began = now

    def _fits(self, now: float) -> bool:
        """A lend is open and has room for this thread's next slice."""
        if now >= self._lent_until or self._lend_declined:
            return False
        expected = getattr(self._paced, "first_s" if self._paced.first else "last_s", 0.0)
        return not self._lend_sliced or self._lent_until - now >= expected

    def _end_slice(self, timed: bool = True) -> None:
        """Under the lock, on a paced task's thread: its slice (if it was one) ends; `timed`, its length is what
        the next slice of its kind is expected to take."""
        if getattr(self._paced, "slicing", False):
            self._paced.slicing = False
            if timed:
                setattr(self._paced, "first_s" if self._paced.first else "last_s",
                        time.monotonic() - self._paced.began)
            self._slicing -= 1
            self._gate.notify_all()

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

    def pool(self, max_workers: int, thread_name_prefix: str, defer_s: float = 0.0) -> ThreadPoolExecutor:
        """A worker pool whose tasks count; with `defer_s` > 0, each yields to steps for up to that long."""
        if defer_s > 0:
            return _DeferringPool(self, max_workers, thread_name_prefix, defer_s)
        return _CountedPool(self, max_workers, thread_name_prefix)

    def paced_pool(self, max_workers: int, thread_name_prefix: str) -> PacedPool:
        """A worker pool whose tasks do not count and, while an engine computes, run in slices within its lends."""
        return PacedPool(self, max_workers, thread_name_prefix)

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
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=init_worker_thread)
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


class PacedPool(ThreadPoolExecutor):
    """Its tasks do not count; while an engine computes they take turns and run in slices within its lends."""

    def __init__(self, work: BackgroundWork, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=init_worker_thread)
        self._work = work

    def submit(self, fn: Callable, /, *args) -> Future:
        return self.submit_paced(None, fn, *args)

    def submit_paced(self, until: float | None, fn: Callable, /, *args,
                     unwanted: Callable[[], bool] | None = None) -> Future:
        """A task that runs within lends until monotonic `until` (None: no bound), and in one piece after it.
        Its future is done before its last slice ends: the lend that ran it to its end returns with its result
        there to collect. Once `unwanted()` is true, it stops where its next slice would start (its future
        then holds TaskAbandoned)."""
        work = self._work
        with work._lock:
            work._paced_queued += 1
        result: Future = Future()
        started = threading.Event()
        try:
            queued = super().submit(self._paced, started, result, until, unwanted, fn, args)
        except BaseException:  # shut down: nothing was queued
            self._unqueue()
            raise
        result.add_done_callback(lambda _: None if started.is_set() else self._unqueue())  # cancelled unstarted
        queued.add_done_callback(lambda f: result.cancel() if f.cancelled() else None)  # a shutdown cancelled it
        return result

    def _unqueue(self) -> None:
        with self._work._lock:
            self._work._paced_queued -= 1
            self._work._gate.notify_all()

    def _paced(self, started: threading.Event, result: Future, until: float | None,
               unwanted: Callable[[], bool] | None, fn: Callable, args: tuple) -> None:
        work = self._work
        turn = work._paced_turn if work._engines_computing else None
        if turn is not None:
            turn.acquire()
        work._paced.turn = turn
        try:
            if not result.set_running_or_notify_cancel():
                return  # cancelled while queued: it left the count then
            work._paced.until, work._paced.unwanted = until, unwanted
            with work._lock:
                started.set()
                work._paced_queued -= 1
                work._begin_slice(first=True)
            try:
                work._check_wanted()  # it may have waited long for this first slice
                result.set_result(fn(*args))
            except BaseException as e:  # the caller's to see, as from any executor
                result.set_exception(e)
            finally:
                with work._lock:
                    work._end_slice()
                work._paced.until, work._paced.unwanted = False, None
        finally:
            if turn is not None:
                turn.release()
            work._paced.turn = None


class _DeferringPool(ThreadPoolExecutor):
    """Its tasks start when the engines are idle or `defer_s` after their submission, and count from then."""

    def __init__(self, work: BackgroundWork, max_workers: int, thread_name_prefix: str, defer_s: float) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=init_worker_thread)
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
