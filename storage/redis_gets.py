"""GETs sent at once and their values read one at a time, when each is wanted.

redis-py's pipeline reads every reply before it returns, and reads them
where it waits for the server. A load waited for its value beside the engine's
steps (the round trip holds no core), so the value's receive, a 12 MB copy
off the socket, ran beside them too, and a request's eight values read ahead
came off in one burst. Here the call is sent on a connection held for it and
only its first reply awaited (`RedisStore.send_gets`, inside the caller's
`waiting`); each value is read by whoever asks for it (`read`), in the load's
own paced slice (`bench stall`, one run each way: the streams' ITL p99 1.98x
against 1.59x through its slow Redis, 1.63x against 1.21x through a fast one,
the loads' TTFT 10-20% longer).
The replies come in order: a value read before its turn reads those ahead of
it too, and keeps them for their askers.

One server's connection (a single server, or Sentinel's master). A Cluster
spreads the keys over nodes: its pipeline reads them all (`ReadGets`).

A failure while reading (a timeout, a dropped connection) answers None for
that value and every later one, and is reported to the store (its counts and
circuit breaker); the connection is closed, never given back with replies
unread, and so is one whose unread values nobody wants any more (`drop`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError


class SentGets(Protocol):
    def read(self, index: int) -> bytes | None:
        """The value of the `index`-th key (once); None when it is not there or the call failed."""
        ...

    def drop(self, index: int) -> None:
        """Nobody will read the `index`-th value."""
        ...


class ReadGets:
    """Values read already (a Cluster's pipeline)."""

    def __init__(self, values: Sequence[bytes | None]) -> None:
        self._values: list[bytes | None] = list(values)

    def read(self, index: int) -> bytes | None:
        value, self._values[index] = self._values[index], None
        return value

    def drop(self, index: int) -> None:
        self._values[index] = None


class PipelinedGets:
    """GETEXs of `names` sent on `connection` (taken from `pool`), read as asked."""

    def __init__(self, pool, connection, names: Sequence[bytes], ttl_s: int,
                 failed: Callable[[Exception], None]) -> None:
        self._pool = pool
        self._connection = connection
        self._failed = failed
        self._lock = threading.Lock()
        self._count = len(names)
        self._next = 0  # the next reply on the socket
        self._kept: dict[int, bytes | None] = {}  # read before their askers came
        self._unwanted: set[int] = set()
        self._broken = False
        try:
            connection.send_packed_command(connection.pack_commands([("GETEX", n, "EX", ttl_s) for n in names]))
        except BaseException:
            self._broken = True
            self.close()
            raise

    def wait_first(self, timeout_s: float) -> None:
        """Waits for the first reply's first bytes (the round trip); raises redis's TimeoutError past
        `timeout_s` (and closes: nobody reads it then)."""
        try:
            if not self._connection.can_read(timeout=timeout_s):
                raise RedisTimeoutError(f"no reply in {timeout_s:.3g} s")
        except BaseException:
            self._broken = True
            self.close()
            raise

    def read(self, index: int) -> bytes | None:
        with self._lock:
            while self._next <= index and not self._broken and self._connection is not None:
                try:
                    value = self._connection.read_response()
                except (RedisError, OSError) as e:
                    self._broken = True
                    self._failed(e)
                    break
                if self._next not in self._unwanted:
                    self._kept[self._next] = value
                self._next += 1
            value = self._kept.pop(index, None)
            self._unwanted.add(index)
            self._release_if_done()
            return value

    def drop(self, index: int) -> None:
        with self._lock:
            self._kept.pop(index, None)
            self._unwanted.add(index)
            self._release_if_done()

    def close(self) -> None:
        """Nobody will read any of its values."""
        with self._lock:
            self._kept.clear()
            self._unwanted.update(range(self._count))
            self._release_if_done()

    def _release_if_done(self) -> None:
        if self._connection is None or not self._unwanted.issuperset(range(self._next, self._count)):
            return
        if self._broken or self._next < self._count:
            self._connection.disconnect()  # replies left on it, or a failure: a new connection for the next call
        self._pool.release(self._connection)
        self._connection = None
