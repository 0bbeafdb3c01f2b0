"""The fleet's epoch: mixed into every remote key, kept in Redis so that all hosts share it.

An invalidation on any host starts a new fleet epoch (INCR in Redis); the
others read it at most `FLEET_EPOCH_REFRESH_S` (and a round trip) later, and
from then on never find what was stored before. Those reads run on a thread
of their own: a lookup uses the epoch it has, and never waits for a far or
slow Redis to answer what is nearly always the same number. While the epoch
is unknown (Redis down since start) the remote tier is not used at all: a
guessed epoch could serve KV another host has invalidated.

It also remembers the keys this host stored or found under the current epoch
(a bounded set), so a chunk is sent to the fleet once, not with every request
that computes it again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import xxhash

from kvtierd.storage.redis_store import RedisStore

FLEET_EPOCH_REFRESH_S = 2.0
KNOWN_KEYS = 1 << 16


class FleetEpoch:
    def __init__(self, store: RedisStore, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self.value: int | None = None
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # `_known`: a read's new epoch clears it on the reading thread
        self._reading = False
        self._read_at = self._clock()
        self._read()

    def refresh(self) -> int | None:
        """The epoch as last read (None: never read yet); when that read is older than FLEET_EPOCH_REFRESH_S,
        a new one starts on a thread of its own, whose answer serves from when it arrives."""
        now = self._clock()
        if now - self._read_at >= FLEET_EPOCH_REFRESH_S and not self._reading:
            self._read_at = now
            self._reading = True
            threading.Thread(target=self._read, name="kvtierd-fleet-epoch", daemon=True).start()
        return self.value

    def bump(self) -> None:
        """Starts a new epoch for the whole fleet."""
        value = self._store.bump_epoch()
        if value is not None:
            self._set(value)
        else:
            self._read_at = -FLEET_EPOCH_REFRESH_S  # not reached: read it again before the next use

    def key(self, block_hash: bytes) -> bytes:
        assert self.value is not None, "the fleet's epoch is not known"
        return xxhash.xxh3_128(self.value.to_bytes(8, "little") + block_hash).digest()

    def knows(self, key: bytes) -> bool:
        return key in self._known

    def remember(self, key: bytes) -> None:
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            if len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    def _read(self) -> None:
        try:
            value = self._store.read_epoch()
            if value is not None:
                self._set(value)
        finally:
            self._reading = False

    def _set(self, value: int) -> None:
        with self._lock:
            if value != self.value:
                self._known.clear()
            self.value = value
