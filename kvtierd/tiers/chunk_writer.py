"""A lower tier's writer: one thread that encodes chunks and stores them, in submission order.

The engine thread only copies KV out of the device (into a CPU tensor it hands
over) and returns; zstd and the store's I/O (LMDB's fsync, Redis round trips)
happen here. One thread per store is enough: LMDB serializes writers anyway,
and order matters (a session's delete must land after its earlier writes).
Copies waiting here are bounded in bytes: past `max_pending_bytes` new ones
are dropped and counted, never waited for.

Its work yields to the engine's steps (`defer_s`, tiers/background_work.py):
a chunk, and whatever is queued behind it, waits while the engine has steps
to run, up to `defer_s` after its submission. A finished turn's copy out of
the device yields the same way (its pages stay referenced until it is made);
an evicted chunk's copy is made at once, before its pages are reused. A
deferred chunk counts in `max_pending_bytes` from its submission. `close`
writes what waits without further delay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.redis_store import RedisStore
from kvtierd.storage.kv_frame import ChunkIdentity, encode_frame
from kvtierd.storage.store_errors import StoreUnavailableError
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.transfer import TransferStats

log = logging.getLogger(__name__)


class ChunkWriter:
    def __init__(self, tier: str, store: DiskStore | RedisStore, codec: str, max_pending_bytes: int,
                 stats: TransferStats | None = None, defer_s: float = 0.0) -> None:
        self.tier = tier
        self._stats = stats  # each committed store's time (encoding included) and KV bytes
        self.store = store
        self.codec = codec
        self.max_pending_bytes = max_pending_bytes
        self._pool = BACKGROUND_WORK.pool(1, f"kvtierd-{tier}", defer_s)
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}  # key -> bytes of its copy, until committed
        self._pending_bytes = 0
        self.num_written = 0  # chunks committed
        self.num_dropped = 0  # chunks not written: the queue was full, or the store failed
        self.failure: str | None = None

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def has(self, key: bytes) -> bool:
        """Stored or on its way (a read on the caller's thread: LMDB reads take no lock and no I/O wait
        beyond the page cache)."""
        with self._lock:
            if key in self._pending:
                return True
        return bool(self.call(lambda: self.store.contains_prefix([key]) == 1, False))

    def has_room(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` may be queued now (ask before copying it out of the device). An empty
        queue takes one of any size."""
        with self._lock:
            return self.failure is None and (not self._pending or self._pending_bytes + nbytes <= self.max_pending_bytes)

    def note_dropped(self, n: int = 1) -> None:
        with self._lock:
            self.num_dropped += n

    def submit(self, key: bytes, identity: ChunkIdentity, kv: torch.Tensor | Future, cataloged: bool = False) -> None:
        """Queues a chunk: its key, identity and KV (a CPU tensor, or the future of its copy out of the device);
        ask `has_room` first. `cataloged` (disk only): a session's turn wrote it, and the SQL catalog will
        name it."""
        nbytes = identity.payload_nbytes
        with self._lock:
            self._pending[key] = nbytes
            self._pending_bytes += nbytes
        self._pool.submit(self._write, [(key, identity, kv)], cataloged)

    def run(self, fn: Callable[[], object]) -> Future:
        """Runs `fn` on the writer thread after everything submitted before it."""
        return self._pool.submit(self._guarded, fn)

    def delete(self, keys: Sequence[bytes]) -> None:
        self.run(lambda: self.store.delete_many(keys))

    def quarantine(self, key: bytes, reason: str) -> None:
        self.run(lambda: self.store.quarantine(key, reason))

    def wait(self) -> None:
        """Blocks until everything submitted so far is done (not on the event loop; nor on the engine's thread
        while it has steps to run: the writes yield to them)."""
        self.run(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write(self, chunks: list[tuple[bytes, ChunkIdentity, torch.Tensor | Future]], cataloged: bool) -> None:
        stored = False
        t0 = time.perf_counter()
        try:
            chunks = [(key, identity, kv.result() if isinstance(kv, Future) else kv) for key, identity, kv in chunks]
            items = [(key, encode_frame(identity, kv.reshape(-1).view(torch.uint8).numpy(), codec=self.codec))
                     for key, identity, kv in chunks]
            owner = chunks[0][1].namespace  # one chunk per batch (`submit`): the stores keep who stored it
            marks = {"cataloged": True} if cataloged else {}  # only the disk store is given cataloged chunks
            with BACKGROUND_WORK.waiting():  # the store's I/O (a Redis round trip, an fsync): no core held past a bit
                stored = bool(self._guarded(lambda: self.store.put_many(items, owner=owner, **marks)))
        except Exception:  # a bug, not the disk: the executor would swallow it silently
            log.exception("writing %d chunk(s) to the %s KV tier failed", len(chunks), self.tier)
        finally:
            with self._lock:
                for key, _, _ in chunks:
                    self._pending_bytes -= self._pending.pop(key, 0)
        if stored and self._stats is not None:
            self._stats.observe(self.tier, "store", time.perf_counter() - t0,
                                sum(kv.numel() * kv.element_size() for _, _, kv in chunks))
        with self._lock:
            if stored:
                self.num_written += len(chunks)
            else:
                self.num_dropped += len(chunks)

    def _guarded(self, fn: Callable[[], object]) -> object:
        return self.call(fn, None)

    def call(self, fn: Callable[[], object], default: object) -> object:
        """Runs a store call; a failing store is remembered (the tier then reports itself down)."""
        if self.failure is not None:
            return default
        try:
            return fn()
        except StoreUnavailableError as e:
            if self.failure is None:
                log.error("%s KV tier failed, continuing without it: %s", self.tier, e)
            self.failure = str(e)
            return default
