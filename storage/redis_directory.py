"""Which chunks a keyspace's server holds, known on this host without a round trip.

A far or slow Redis costs every lookup its round trip, a miss as much as a
hit: a new prompt waited that long before computing, or gave up on the fleet
to compute at once. The directory answers a lookup from memory instead:

    fill     SUBSCRIBE to the keyspace's channel, then SCAN its value names
    follow   every daemon's RedisStore publishes the names it stores on that
             channel, in the same pipeline as their SETs (`RedisStore.put_many`)
    upkeep   this host's own stores, hits and deletes, as they happen; SCAN
             again every RESCAN_S, which drops what went away unannounced

It is complete once its subscription is confirmed and its first scan has
ended (a name stored during the scan is heard, so nothing falls between the
two), and stays so while the subscription lives. Until then, after its
connection drops (it subscribes and scans again, every RETRY_S), or when the
server holds more than `max_keys` chunks, it answers nothing and lookups ask
the server.

A hint, not the truth: a value expired, evicted by the server's memory
policy, or deleted by another host stays known until the next scan (the
load's GET then misses, and the request computes those tokens, as one that
raced an eviction does); a value stored by another host a moment ago is
unknown until its name arrives (the request computes it). Values renewed
by other hosts' reads are never dropped by this host's clock: only a scan
removes names.

One thread of its own, and one connection (the subscription); the scans use
the store's client. Its failures are not the store's: they do not count
against the circuit breaker, and a directory that cannot follow (an ACL
without SUBSCRIBE or SCAN) only makes lookups ask, as they did without it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from redis.exceptions import RedisClusterException, RedisError

log = logging.getLogger(__name__)

RESCAN_S = 600.0
RETRY_S = 1.0
SCAN_COUNT = 1000  # names a SCAN call returns about: few calls for a fleet's keyspace, short ones for the server
MAX_KEYS = 1 << 20  # ~100 MB of Python set at most; past it lookups ask the server
LISTEN_S = 0.5  # how long one wait for a message lasts: how soon `close` is noticed

_FAILURES = (RedisError, RedisClusterException, OSError)


class RedisDirectory:
    def __init__(self, client: Callable[[], object], channel: bytes, name_prefix: bytes,
                 rescan_s: float = RESCAN_S, max_keys: int = MAX_KEYS) -> None:
        """`client()`: the store's Redis client; `channel`: where the keyspace's stores are announced (each
        message the stored names' keys in hex, space-separated); `name_prefix`: what precedes a key's hex in a
        value's name."""
        self._client = client
        self._channel = channel
        self._prefix = name_prefix
        self._rescan_s = rescan_s
        self._max_keys = max_keys
        self._keys: set[bytes] | None = None  # None: not complete
        self._scanning: set[bytes] | None = None  # a rescan's names so far: this host's own news goes there too
        self._closed = threading.Event()
        self.too_many = False
        self._failing = False  # its last try failed (logged once until it follows again)
        self._thread = threading.Thread(target=self._run, name="kvtierd-redis-directory", daemon=True)
        self._thread.start()

    @property
    def complete(self) -> bool:
        return self._keys is not None

    @property
    def num_keys(self) -> int:
        keys = self._keys
        return len(keys) if keys is not None else 0

    def holds_each(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether the server holds each key, as far as the directory knows; None while it is not complete."""
        known = self._keys
        return None if known is None else [k in known for k in keys]

    def add(self, keys: Iterable[bytes]) -> None:
        """This host stored or read these."""
        keys = list(keys)
        for target in (self._keys, self._scanning):
            if target is not None:
                target.update(keys)

    def discard(self, keys: Iterable[bytes]) -> None:
        """This host deleted these."""
        keys = list(keys)
        for target in (self._keys, self._scanning):
            if target is not None:
                target.difference_update(keys)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(RETRY_S + LISTEN_S + 1.0)

    # -- its thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.is_set() and not self.too_many:
            try:
                self._follow()
            except _FAILURES as e:
                if not self._failing:
                    log.info("remote KV tier: not following the fleet's stores for now, lookups ask the server "
                             "(%s: %s)", type(e).__name__, e)
                self._failing = True
            self._keys = None
            self._closed.wait(RETRY_S)

    def _follow(self) -> None:
        client = self._client()
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(self._channel)
            while (message := pubsub.get_message(timeout=LISTEN_S)) is None or message["type"] != "subscribe":
                if self._closed.is_set():
                    return
            while not self._closed.is_set():
                self._scan(client)
                if self.too_many:
                    return
                rescan_at = time.monotonic() + self._rescan_s
                while not self._closed.is_set() and time.monotonic() < rescan_at:
                    message = pubsub.get_message(timeout=LISTEN_S)
                    if message is not None and message["type"] == "message":
                        self.add(k for k in map(_key_of_hex, message["data"].split()) if k is not None)
                        if self.num_keys > self._max_keys:
                            return self._give_up()
        finally:
            pubsub.close()

    def _scan(self, client) -> None:
        scanning = self._scanning = set()
        try:
            for name in client.scan_iter(match=_glob_escaped(self._prefix) + b"*", count=SCAN_COUNT):
                key = _key_of(name, self._prefix)
                if key is not None:
                    scanning.add(key)
                    if len(scanning) > self._max_keys:
                        return self._give_up()
            self._keys = scanning  # before the rescan's set is let go: news meanwhile went to both
        finally:
            self._scanning = None
        if self._failing:
            log.info("remote KV tier: following the fleet's stores again (%d chunks)", len(scanning))
            self._failing = False

    def _give_up(self) -> None:
        self.too_many = True
        log.warning("remote KV tier: the fleet holds over %d chunks of this keyspace; lookups ask the server",
                    self._max_keys)


def _key_of(name: bytes, prefix: bytes) -> bytes | None:
    """The chunk key a value's name holds; None for the keyspace's other names (its epoch, its ledgers)."""
    return _key_of_hex(name[len(prefix):])


def _key_of_hex(text: bytes) -> bytes | None:
    """None for what is no hex (a message on the channel that no RedisStore sent)."""
    try:
        return bytes.fromhex(text.decode())
    except (ValueError, UnicodeDecodeError):
        return None


def _glob_escaped(text: bytes) -> bytes:
    for special in (b"\\", b"*", b"?", b"[", b"]"):
        text = text.replace(special, b"\\" + special)
    return text
