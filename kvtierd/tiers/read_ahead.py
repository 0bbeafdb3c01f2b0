"""A remote request's later chunks read ahead of their loads.

A request's loads run LOADS_AHEAD at a time (cache/loading.py: each takes its
device pages as it starts), so a Redis that answers each call late made them
wait its delay one pair after another: at 300 ms a call, a 2,560-token
prompt's ten chunks waited five delays, past what recomputing them would take.
A value needs no pages, only its load's copy does: so as a request's loads
start, the values of its other chunks are read in one call beside its first
loads' own round trips, and a load finds its value here, waiting for the call
if it is still on its way. Only the round trip: the tags are checked, the
frame decoded and copied in the load, paced like any other. The values come
off the socket at once, their receive (and a proxy's relay) beside the steps:
eight of the bundled model's chunks (96 MB) through `bench stall`'s slow Redis
held the streams' steps up to ~70 ms, against 2 s for the recompute that the
loads made too late turned into. So the remote tier reads ahead only when its
round trips are slow (remote_backend.py); a fast one's loads read as they go.

At most `limit` values are held or on their way; a request that ends before
its loads took them drops them (`drop`): a call none of whose values is
wanted any more does not start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvtierd.tiers.background_work import init_worker_thread

READ_AHEAD_THREADS = 2  # calls on their way at once: two requests' reads do not queue behind each other
MAX_READ_AHEAD = 16  # values held or on their way, at most (a bundled-model chunk: 12 MB)

# The values of these keys as stored, in one call (None for a key not there); None when the call failed.
FetchMany = Callable[[Sequence[bytes]], "list[bytes | None] | None"]


@dataclass(frozen=True, slots=True)
class AheadValue:
    """One key's value in a call made ahead."""

    call: Future
    index: int

    def result(self) -> bytes | None:
        """Its value (waiting for the call); None when it is not there or the call failed."""
        values = self.call.result()
        return None if values is None else values[self.index]


class ReadAhead:
    def __init__(self, fetch_many: FetchMany, threads: int = READ_AHEAD_THREADS, limit: int = MAX_READ_AHEAD) -> None:
        self._fetch_many = fetch_many
        self._limit = limit
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtierd-read-ahead",
                                        initializer=init_worker_thread)
        self._lock = threading.Lock()
        self._ahead: dict[bytes, AheadValue] = {}
        self._wanted: dict[Future, int] = {}  # a call -> its values not taken nor dropped yet

    def start(self, keys: Iterable[bytes]) -> None:
        """Reads these keys' values in one call, but those already on their way and those past the limit."""
        with self._lock:
            new = list(dict.fromkeys(k for k in keys if k not in self._ahead))[: self._limit - len(self._ahead)]
            if not new:
                return
            call = self._pool.submit(self._fetch_many, new)
            self._wanted[call] = len(new)
            for i, key in enumerate(new):
                self._ahead[key] = AheadValue(call, i)

    def take(self, key: bytes) -> AheadValue | None:
        """The value of `key` read ahead (no longer held here); None when none was."""
        with self._lock:
            value = self._ahead.pop(key, None)
            if value is not None:
                self._unwant(value.call)
            return value

    def drop(self, keys: Iterable[bytes]) -> None:
        """Forgets these keys' values; a call none of whose values is wanted any more does not start."""
        with self._lock:
            for key in keys:
                value = self._ahead.pop(key, None)
                if value is not None and self._unwant(value.call):
                    value.call.cancel()

    def clear(self) -> None:
        with self._lock:
            keys = list(self._ahead)
        self.drop(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ahead)

    def close(self) -> None:
        self.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _unwant(self, call: Future) -> bool:
        """One value of `call` is no longer held; True when it was its last."""
        self._wanted[call] -= 1
        if self._wanted[call]:
            return False
        del self._wanted[call]
        return True
