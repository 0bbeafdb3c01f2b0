"""The remote tier: chunk values in a Redis or Valkey server that a fleet of daemons shares.

    key    <keyspace prefix>s<secret id>:<hex of the chunk key>     (redis_keyspace.py, value_seal.py)
    value  HMAC tag || kv_frame, written with SET ... EX ttl

A read is GETEX ... EX ttl: a hit renews the value's TTL, which is this tier's
"use" for the LRU; the TTL bounds what the tier keeps, and the server's
maxmemory-policy (allkeys-lru is the one to pick) does the rest. A value whose
tag fails is a miss: it is deleted and counted, never returned.

Batches. Every call is one pipeline of single-key commands (GETEX, SET, EXISTS,
UNLINK), not MGET/MSET: a Cluster refuses multi-key commands across slots, and
hash tags would let them through only by putting all of a store's keys in one
slot, that is on one node. Single-key commands keep each key in its own slot,
so the load spreads over the masters, and the cluster pipeline sends each node
its share; on one server a pipeline is one round trip, as MGET is. So one code
path serves a single server, Sentinel and Cluster.

All or nothing, nearly: a batch is not a transaction (MULTI cannot span
slots). A put the server refuses for memory (OOM under noeviction) is undone,
its keys deleted; a put cut off by a failure may leave some of its values,
each whole and sealed, until their TTL.

Never an error to a request. Redis down, slow or full answers a miss, False or
0 and is counted (`num_failures`, `num_rejected` for OOM). Errors and timeouts
go to a circuit breaker; while it is open calls answer at once without
touching the network, and `stats()` says why. Memory refusals do not count
against the breaker: a full server still answers, and reads still work.

Per-tenant limits (`limit_by`): a write of an owner with a limit is one Lua
script that also keeps the owner's ledger in Redis and deletes its own oldest
values past its limit (redis_ledger.py), atomic across the fleet. Without a
limit a write is the plain pipeline above, and no ledger key is written.

Its directory (`follow`, redis_directory.py): every store is announced on the
keyspace's channel, in the same pipeline as its SETs (a Cluster's after them:
its pipelines take no PUBLISH), so a daemon that follows them knows what the
fleet holds without asking the server.

Threads: any thread may call any method; redis-py's connection pool hands each
its own connection. `stats()` does no I/O: the server's figures come from an
INFO read at most every USAGE_INTERVAL_S by its puts and its epoch's reads,
which talk to it anyway, never by a read of values: a load waited out that
extra round trip inside its paced slice, and through a Redis 300 ms away the
step that lent it waited SLICE_WAIT_S for it (a 68 ms gap in the streams,
`bench stall`'s slow-Redis scenario).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

from redis.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError

from kvtierd.storage.chunk_store import StoreStats
from kvtierd.storage.codecs import Between, no_pause
from kvtierd.storage.circuit_breaker import BreakerState, CircuitBreaker
from kvtierd.storage.owner_shares import OwnerUsage
from kvtierd.storage.redis_client import RedisClient, open_client, parse_redis_url
from kvtierd.storage.redis_directory import RedisDirectory
from kvtierd.storage.redis_gets import PipelinedGets, ReadGets, SentGets
from kvtierd.storage.redis_keyspace import RedisKeyspace
from kvtierd.storage.redis_ledger import RedisLedger
from kvtierd.storage.store_errors import StoreArgumentError
from kvtierd.storage.value_places import Waiting
from kvtierd.storage.value_seal import ValueSeal

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 24 * 3600
# Short: a remote hit is worth a few milliseconds, and recomputing is always possible.
# The op timeout bounds each socket read, not a whole batch.
DEFAULT_CONNECT_TIMEOUT_MS = 200
DEFAULT_OP_TIMEOUT_MS = 500
USAGE_INTERVAL_S = 5.0
MAX_KEY_BYTES = 255

# redis-py's cluster errors (slot not covered, no node reachable) are not RedisErrors.
_SERVER_FAILURES = (RedisError, RedisClusterException)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServerUsage:
    """The server's own figures (INFO), shared by every keyspace on it; a Cluster's summed over its masters."""

    num_keys: int
    used_bytes: int
    max_bytes: int  # maxmemory; 0: unbounded
    num_evictions: int  # keys the maxmemory-policy evicted since the server started


class RedisStore:
    """A ChunkStore on Redis/Valkey. Raises StoreArgumentError when made with a bad URL, secret or
    setting; after that, never: a failing server gives misses and counts."""

    def __init__(self, url: str, keyspace: RedisKeyspace, secret: bytes, *, ttl_s: int = DEFAULT_TTL_S,
                 connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS, op_timeout_ms: int = DEFAULT_OP_TIMEOUT_MS,
                 breaker: CircuitBreaker | None = None) -> None:
        if ttl_s < 1 or connect_timeout_ms < 1 or op_timeout_ms < 1:
            raise StoreArgumentError(
                f"ttl_s, connect_timeout_ms and op_timeout_ms must be positive, got {ttl_s}, "
                f"{connect_timeout_ms} and {op_timeout_ms}"
            )
        self.target = parse_redis_url(url)
        self._seal = ValueSeal(secret)
        self.key_prefix = f"{keyspace.key_prefix}s{self._seal.key_id}:"
        self.ttl_s = ttl_s
        self._connect_timeout_s = connect_timeout_ms / 1000
        self._op_timeout_s = op_timeout_ms / 1000
        self._breaker = breaker or CircuitBreaker()
        self._client: RedisClient | None = None
        self._client_lock = threading.Lock()  # one client, made on first use
        self._lock = threading.Lock()  # the counters
        self._closed = False
        self._usage = ServerUsage(0, 0, 0, 0)
        self._usage_at = -math.inf
        self._num_puts = self._num_gets = self._num_hits = 0
        self._num_rejected = self._num_corrupt = self._num_failures = 0
        self._ledger = RedisLedger(self.key_prefix, ttl_s)
        self._cap: Callable[[bytes], int | None] | None = None  # bytes an owner may hold (None: any); None: no limits
        self._over_limit: Counter[bytes] = Counter()  # batches refused at their owner's limit
        self.announce_channel = f"{self.key_prefix}stored".encode()
        self.directory: RedisDirectory | None = None  # `follow`
        self.round_trip_s: float | None = None  # its small calls (EXISTS, the epoch's GET) lately; None: none yet

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        found = self.contains_each(keys)
        return next((n for n, there in enumerate(found) if not there), len(found))

    def follow(self) -> RedisDirectory:
        """Starts its directory (once): which chunks the server holds, known here (`known_each`)."""
        if self.directory is None:
            self.directory = RedisDirectory(self._connected, self.announce_channel, self.key_prefix.encode())
        return self.directory

    def known_each(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether the server holds each key as its directory knows, without a call; None: it does not know
        (not following, or not complete)."""
        return self.directory.holds_each(keys) if self.directory is not None else None

    def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        names = self._names(keys)
        if not names:
            return []

        def exists(client: RedisClient) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        # All asked in one round trip. A forged value counts as present here (EXISTS reads no bytes); get_many
        # refuses it. None: the server failed (answered as a miss, and counted).
        found = self._timed(exists)
        return [bool(there) for there in found] if found is not None else [False] * len(names)

    def get_many(self, keys: Sequence[bytes], between: Between = no_pause,
                 waiting: Waiting | None = None) -> list[memoryview | None]:
        """The frames, each a read-only view into the value redis-py read (one copy off the socket, none
        after); `between` is called after the read and between slices of checking their tags, and `waiting()`
        put around the round trip (the server's first answer: the values are read after it)."""
        return self.unseal_many(keys, self.get_sealed(keys, waiting), between)

    def get_sealed(self, keys: Sequence[bytes], waiting: Waiting | None = None) -> list[bytes | None] | None:
        """The values as the server holds them (tags unchecked: `unseal_many`), in one round trip inside
        `waiting()`; None when the call failed."""
        gets = self.send_gets(keys, waiting)
        return None if gets is None else [gets.read(i) for i in range(len(keys))]

    def send_gets(self, keys: Sequence[bytes], waiting: Waiting | None = None) -> SentGets | None:
        """GETEX of each key (a hit renews its TTL: the tier's LRU) in one call, its first reply awaited inside
        `waiting()` (the round trip); each value is read off the connection when asked for (redis_gets.py).
        None when the call failed."""
        names = self._names(keys)
        with self._lock:
            self._num_gets += len(names)
        if not names:
            return ReadGets([])

        def getex(client: RedisClient) -> SentGets:
            if isinstance(client, RedisCluster):  # its keys are on several nodes: read them all now
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.getex(name, ex=self.ttl_s)
                return ReadGets(pipe.execute())
            pool = client.connection_pool
            gets = PipelinedGets(pool, pool.get_connection(), names, self.ttl_s, self._failed)
            gets.wait_first(self._op_timeout_s)
            return gets

        with waiting() if waiting is not None else nullcontext():
            return self._call(getex)

    def unseal_many(self, keys: Sequence[bytes], sealed: Sequence[bytes | None] | None,
                    between: Between = no_pause) -> list[memoryview | None]:
        """The frames of values `get_sealed` read for `keys` (None: that call failed), their tags checked:
        a value whose tag fails is deleted and answers None; `between` is called first and between slices."""
        if sealed is None:
            return [None] * len(keys)
        if not keys:
            return []
        names = self._names(keys)
        between()
        frames = [None if s is None else self._seal.unseal(name, s, between)
                  for name, s in zip(names, sealed, strict=True)]
        forged = [i for i, (s, f) in enumerate(zip(sealed, frames, strict=True)) if s is not None and f is None]
        with self._lock:
            self._num_hits += sum(f is not None for f in frames)
        if self.directory is not None:
            self.directory.add(k for k, f in zip(keys, frames, strict=True) if f is not None)
        if forged:
            self._discard([keys[i] for i in forged])
            self._drop([names[i] for i in forged],
                       "its HMAC tag does not match (forged, altered, or sealed under another secret)")
        return frames

    def put_many(self, items: Sequence[tuple[bytes, bytes]], owner: bytes = b"") -> bool:
        """`owner`: the tenant namespace the values belong to (its limit, if it has one; b"": none)."""
        batch = dict(items)  # a key given twice keeps its last value
        names = self._names(list(batch))
        if not names:
            return True
        sealed = [self._seal.seal(name, frame) for name, frame in zip(names, batch.values(), strict=True)]
        limit = self._cap(owner) if self._cap is not None and owner else None
        if limit is not None:
            return self._put_limited(owner, limit, batch, names, sealed)

        cluster = self.target.topology == "cluster"

        def set_ex(client: RedisClient) -> bool:
            pipe = client.pipeline(transaction=False)
            for name, value in zip(names, sealed, strict=True):
                pipe.set(name, value, ex=self.ttl_s)
            if not cluster:
                pipe.publish(self.announce_channel, _announcement(batch))
            try:
                pipe.execute()
            except OutOfMemoryError:
                # Full under noeviction: some SETs may have landed before the rest were refused. Undo them;
                # deletes are allowed on a full server.
                undo = client.pipeline(transaction=False)
                for name in names:
                    undo.unlink(name)
                undo.execute()
                return False
            if cluster:
                client.publish(self.announce_channel, _announcement(batch))
            return True

        stored = self._call(set_ex)
        with self._lock:
            if stored:
                self._num_puts += len(names)
            elif stored is False:
                self._num_rejected += 1
        if stored:
            self._stored(batch)
        return bool(stored)

    def limit_by(self, cap_bytes: Callable[[bytes], int | None]) -> None:
        """An owner may hold at most `cap_bytes(owner)` sealed bytes in the server (None: no limit), counted
        across every daemon that writes its values. Raises StoreArgumentError on a Cluster."""
        if self.target.topology == "cluster":
            raise StoreArgumentError(
                "per-tenant remote limits need one Redis master (single or Sentinel): a tenant's values are "
                "spread over a Cluster's slots, and one script cannot delete them atomically there"
            )
        self._cap = cap_bytes

    @property
    def has_limits(self) -> bool:
        return self._cap is not None

    def usage_by_owner(self, owners: Iterable[bytes]) -> dict[bytes, OwnerUsage]:
        """What the owners with a limit hold, as their ledgers record it (one round trip); {} without limits or
        when the server failed. The over-limit counts are this daemon's."""
        limited = [o for o in owners if self._cap is not None and self._cap(o) is not None]
        if not limited:
            return {}
        usage = self._call(lambda client: self._ledger.usage(client, limited))
        if usage is None:
            return {}
        with self._lock:
            return {o: OwnerUsage(u.entries, u.nbytes, self._over_limit[o])
                    for o, u in zip(limited, usage, strict=True)}

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._discard(keys)
        return self._unlink(self._names(keys))

    def quarantine(self, key: bytes, reason: str) -> bool:
        """Deletes a value the caller found bad (decode_frame failed), counting it corrupt.

        Returns whether it was there. Nothing is kept for inspection: the server is shared, and the
        log names the key and the reason."""
        self._discard([key])
        return self._drop(self._names([key]), reason) == 1

    def read_epoch(self) -> int | None:
        """The fleet's invalidation epoch (0 before the first invalidation); None when the server failed.

        Mixed into every key by the tier above, so one host's invalidation reaches the whole fleet."""
        answer = self._timed(lambda client: (client.get(self._epoch_name()),))  # a tuple: None means it failed
        if answer is None:
            return None
        self._refresh_usage_if_stale()
        return int(answer[0]) if answer[0] is not None else 0

    def bump_epoch(self) -> int | None:
        """Starts a new fleet epoch (what was stored so far becomes unreachable); None when the server failed."""
        return self._call(lambda client: client.incr(self._epoch_name()))

    def _epoch_name(self) -> bytes:
        return f"{self.key_prefix}epoch".encode()

    def refresh_usage(self) -> ServerUsage | None:
        """Reads the server's key count, memory and evictions now (one INFO per master); None if that failed."""
        usage = self._call(_read_usage)
        with self._lock:
            self._usage_at = time.monotonic()  # on a failure too: a down server is not asked on every call
            if usage is not None:
                self._usage = usage
        return usage

    def stats(self) -> StoreStats:
        status = self._breaker.status()
        with self._lock:
            if self._closed:
                healthy, reason = False, "closed"
            elif status.state is BreakerState.CLOSED:
                healthy, reason = True, None
            else:
                healthy = False
                reason = (f"Redis {self.target.where} unreachable, circuit {status.state.value}: {status.reason}; "
                          f"next try in {status.retry_in_s:.1f} s")
            return StoreStats(
                num_entries=self._usage.num_keys,
                bytes_used=self._usage.used_bytes,
                capacity_bytes=self._usage.max_bytes,
                num_puts=self._num_puts,
                num_gets=self._num_gets,
                num_hits=self._num_hits,
                num_evictions=self._usage.num_evictions,
                num_rejected=self._num_rejected,
                num_corrupt=self._num_corrupt,
                num_quarantined=0,  # bad values are deleted, never kept
                healthy=healthy,
                reason=reason,
                num_failures=self._num_failures,
            )

    def close(self) -> None:
        """Closes the connections; later calls answer misses."""
        if self.directory is not None:
            self.directory.close()
        with self._client_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except (*_SERVER_FAILURES, OSError) as e:
                log.debug("closing the Redis client: %s", e)

    # -- calls ----------------------------------------------------------------------------------

    def _call(self, op: Callable[[RedisClient], T]) -> T | None:
        """Runs `op` on the client unless the store is closed or its breaker open; None when it did not succeed."""
        if self._closed or not self._breaker.allow():
            with self._lock:
                self._num_failures += 1
            return None
        try:
            result = op(self._connected())
        except _SERVER_FAILURES as e:
            self._failed(e)
            return None
        if self._breaker.record_success():
            log.info("remote KV tier %s answers again", self.target.where)
        return result

    def _failed(self, e: Exception) -> None:
        """A call to the server failed: counted, and told to the circuit breaker."""
        with self._lock:
            self._num_failures += 1
        reason = f"{type(e).__name__}: {e}"
        if self._breaker.record_failure(reason):
            log.warning("remote KV tier %s is failing, answering misses for now: %s", self.target.where, reason)

    def _put_limited(self, owner: bytes, limit: int, batch: dict[bytes, bytes], names: list[bytes],
                     sealed: list[bytes]) -> bool:
        def put_announced(client: RedisClient):
            put = self._ledger.put(client, owner, limit, names, sealed)
            if put.stored:
                client.publish(self.announce_channel, _announcement(batch))
            return put

        put = self._call(put_announced)
        with self._lock:
            if put is not None and put.stored:
                self._num_puts += len(names)
            elif put is not None:
                self._num_rejected += 1  # over the limit, or refused for memory
                self._over_limit[owner] += put.over_limit
        if put is not None and put.stored:
            self._stored(batch)
        return bool(put and put.stored)

    def _stored(self, keys: Iterable[bytes]) -> None:
        if self.directory is not None:
            self.directory.add(keys)
        self._refresh_usage_if_stale()

    def _discard(self, keys: Sequence[bytes]) -> None:
        if self.directory is not None:
            self.directory.discard(keys)

    def _timed(self, op: Callable[[RedisClient], T]) -> T | None:
        """`_call` for a small call, whose time is the server's round trip (`round_trip_s`: an average weighting
        the latest half)."""
        t0 = time.perf_counter()
        result = self._call(op)
        if result is not None:
            took, last = time.perf_counter() - t0, self.round_trip_s
            self.round_trip_s = took if last is None else (last + took) / 2
        return result

    def _connected(self) -> RedisClient:
        with self._client_lock:
            if self._closed:
                raise RedisError("the store is closed")
            if self._client is None:
                self._client = open_client(self.target, connect_timeout_s=self._connect_timeout_s,
                                           op_timeout_s=self._op_timeout_s)
            return self._client

    def _unlink(self, names: list[bytes]) -> int:
        if not names:
            return 0

        def unlink(client: RedisClient) -> int:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.unlink(name)  # frees a large value off the server's main thread
            return sum(pipe.execute())

        return self._call(unlink) or 0

    def _drop(self, names: list[bytes], reason: str) -> int:
        with self._lock:
            self._num_corrupt += len(names)
        log.warning("remote KV tier: deleting %d bad value(s) (%s): %s", len(names), reason,
                    ", ".join(n.decode() for n in names[:4]))
        return self._unlink(names)

    def _refresh_usage_if_stale(self) -> None:
        with self._lock:
            stale = time.monotonic() - self._usage_at >= USAGE_INTERVAL_S
        if stale:
            self.refresh_usage()

    def _names(self, keys: Sequence[bytes]) -> list[bytes]:
        for key in keys:
            # A bad key is the caller's bug, not a failing server.
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"a chunk key must have 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        prefix = self.key_prefix.encode()
        return [prefix + key.hex().encode() for key in keys]


def _read_usage(client: RedisClient) -> ServerUsage:
    if isinstance(client, RedisCluster):
        infos = list(client.info(target_nodes=RedisCluster.PRIMARIES).values())
    else:
        infos = [client.info()]
    keyspaces = [v for info in infos for k, v in info.items() if k.startswith("db") and isinstance(v, dict)]
    return ServerUsage(
        num_keys=sum(db["keys"] for db in keyspaces),
        used_bytes=sum(info["used_memory"] for info in infos),
        max_bytes=0 if any(info["maxmemory"] == 0 for info in infos) else sum(info["maxmemory"] for info in infos),
        num_evictions=sum(info["evicted_keys"] for info in infos),
    )


def _announcement(keys: Iterable[bytes]) -> bytes:
    """A store's message on the keyspace's channel: its keys in hex, space-separated (redis_directory.py)."""
    return b" ".join(key.hex().encode() for key in keys)
