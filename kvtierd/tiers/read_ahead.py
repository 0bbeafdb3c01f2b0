"""A remote request's later chunks read ahead of their loads.

A request's loads run LOADS_AHEAD at a time (cache/loading.py: each takes its
device pages as it starts), so a Redis that answers each call late made them
wait its delay one pair after another: at 300 ms a call, a 2,560-token
prompt's ten chunks waited five delays, past what recomputing them would take.
A value needs no pages, only its load's copy does: so as a request's loads
start, the values of its other chunks are read in one call beside its first
loads' own round trips, and a load finds its value here, waiting for the call
if it is still on its way. Only the round trip: the value is read off the
connection (held for the call: storage/redis_gets.py), its tag checked, the
frame decoded and copied in the load, paced like any other: read at once on
the read-ahead thread, eight of the bundled model's chunks (96 MB) came off
the socket in one burst beside the streams' steps. The remote tier reads ahead
only when its round trips are slow (remote_backend.py); a fast one's loads
read as they go.

A server executes a call's GETs at once, and a Redis on this host does that
on the engine's cores: it copies each value into its reply buffer (a
bundled-model chunk's GET took redis-server ~7 ms of a core; eight in one
call, 53-65 ms, whatever the client's receive window: a probe). So while an
engine computes, the values are asked for with `spacing_s` between them, each
in a call of its own, and the server's work comes a value at a time, as the
paced loads take them, not in one burst under a few steps.

At most `limit` values are held or on their way; a request that ends before
its loads took them drops them (`drop`): a call none of whose values is
wanted any more does not start, or gives its connection back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvtierd.storage.redis_gets import SentGets
from kvtierd.tiers.background_work import init_worker_thread

MAX_READ_AHEAD = 16  # values held or on their way, at most (a bundled-model chunk: 12 MB)
# Calls on their way at once: one a value, when spaced, so no call waits for a thread while another waits for the
# server, and two requests' reads do not queue behind each other.
READ_AHEAD_THREADS = MAX_READ_AHEAD

# The GETs of these keys sent in one call, its round trip waited for; None when the call failed.
SendGets = Callable[[Sequence[bytes]], "SentGets | None"]


@dataclass(frozen=True, slots=True)
class AheadValue:
    """One key's value in a call made ahead."""

    call: Future
    index: int

    def wait(self) -> None:
        """Waits for its call's round trip."""
        self.call.result()

    def read(self) -> bytes | None:
        """Its value, read off the call's connection (waiting for the call first); None when it is not there
        or the call failed."""
        gets = self.call.result()
        return None if gets is None else gets.read(self.index)


@dataclass(slots=True)
class _OnItsWay:
    """A call not sent yet, or waiting for its round trip."""

    size: int  # its values
    dropped: list[int]  # its values dropped meanwhile: let go as it arrives (all of them: it need not start)


class ReadAhead:
    def __init__(self, send_gets: SendGets, threads: int = READ_AHEAD_THREADS, limit: int = MAX_READ_AHEAD) -> None:
        self._send_gets = send_gets
        self._limit = limit
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtierd-read-ahead",
                                        initializer=init_worker_thread)
        self._lock = threading.Lock()
        self._ahead: dict[bytes, AheadValue] = {}
        self._on_its_way: dict[Future, _OnItsWay] = {}
        self._closed = threading.Event()  # wakes the calls waiting for their time

    def start(self, keys: Iterable[bytes], spacing_s: float = 0.0) -> None:
        """Reads these keys' values, but those already on their way and those past the limit: in one call, or,
        with `spacing_s`, each in a call of its own, sent `spacing_s` after the one before."""
        with self._lock:
            new = list(dict.fromkeys(k for k in keys if k not in self._ahead))[: self._limit - len(self._ahead)]
            groups = [[key] for key in new] if spacing_s > 0 else [new] if new else []
            now = time.monotonic()
            calls = []
            for j, group in enumerate(groups):
                way = _OnItsWay(len(group), [])
                call = self._pool.submit(self._send_at, now + j * spacing_s, group, way)
                self._on_its_way[call] = way
                for i, key in enumerate(group):
                    self._ahead[key] = AheadValue(call, i)
                calls.append(call)
        for call in calls:
            call.add_done_callback(self._arrived)

    def _send_at(self, when: float, keys: list[bytes], way: _OnItsWay) -> SentGets | None:
        """Sends the call at `when`, unless nobody wants its values by then (or the read-ahead closed)."""
        if self._closed.wait(max(0.0, when - time.monotonic())):
            return None
        with self._lock:
            if len(way.dropped) == way.size:
                return None
        return self._send_gets(keys)

    def take(self, key: bytes) -> AheadValue | None:
        """The value of `key` read ahead (no longer held here: its taker reads it); None when none was."""
        with self._lock:
            return self._ahead.pop(key, None)

    def drop(self, keys: Iterable[bytes]) -> None:
        """Forgets these keys' values: a call none of whose values was taken does not start, and a connection
        none of whose values is wanted is given back."""
        unneeded = []
        with self._lock:
            for key in keys:
                value = self._ahead.pop(key, None)
                if value is None:
                    continue
                way = self._on_its_way.get(value.call)
                if way is None:
                    _drop_sent(value.call, value.index)
                    continue
                way.dropped.append(value.index)
                if len(way.dropped) == way.size:
                    unneeded.append(value.call)
        for call in unneeded:
            call.cancel()  # runs `_arrived` at once when it had not started

    def clear(self) -> None:
        with self._lock:
            keys = list(self._ahead)
        self.drop(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ahead)

    def close(self) -> None:
        self.clear()
        self._closed.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _arrived(self, call: Future) -> None:
        """A call's round trip is over (or it was cancelled): the values dropped meanwhile are let go."""
        with self._lock:
            way = self._on_its_way.pop(call)
        for index in way.dropped:
            _drop_sent(call, index)


def _drop_sent(call: Future, index: int) -> None:
    gets = None if call.cancelled() or call.exception() is not None else call.result()
    if gets is not None:
        gets.drop(index)
