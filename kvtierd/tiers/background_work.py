"""The KV tiers' background work (loads, stores, prefetches), counted so a step can leave it a core.

Each worker pool of the tiers is a `BACKGROUND_WORK.pool`: a task counts from
its submission until it ends (or is cancelled). Their work is mostly outside
the GIL (zstd, hashing, memcpy, LMDB, sockets), so it runs beside a step on
another core; the engine reads `busy` before each step (engine/step_threads.py).
Lookups are not counted: they wait on a store far more than they compute. One
count for the process, as its cores and torch's threads are the process's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundWork:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0  # tasks submitted to the pools and not ended

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def pool(self, max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
        return _CountedPool(self, max_workers, thread_name_prefix)

    def _add(self, n: int) -> None:
        with self._lock:
            self._pending += n


class _CountedPool(ThreadPoolExecutor):
    def __init__(self, work: BackgroundWork, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._work = work

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        self._work._add(1)
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:  # shut down: nothing was queued
            self._work._add(-1)
            raise
        future.add_done_callback(lambda _: self._work._add(-1))  # run on cancellation too
        return future


BACKGROUND_WORK = BackgroundWork()
