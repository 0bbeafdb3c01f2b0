"""What the disk and remote tiers share: a store written by its own writer thread (`chunk_writer.py`), values
in a codec of the tier's choosing, checked when read and quarantined when bad."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtierd.storage.codecs import Between, Buffer, no_pause
from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.kv_frame import ChunkIdentity, decode_frame
from kvtierd.storage.redis_store import RedisStore
from kvtierd.storage.store_errors import CorruptValueError
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.backend import Admission
from kvtierd.tiers.chunk import ChunkSpan
from kvtierd.tiers.chunk_writer import ChunkWriter
from kvtierd.tiers.device_chunk import DeviceChunk
from kvtierd.tiers.frame_pages import writable
from kvtierd.tiers.page_copy import PageCopier
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_stats import TierCounts, TierStats, writer_stats
from kvtierd.tiers.transfer import TransferStats

log = logging.getLogger(__name__)


class WriterBackend:
    tier: Tier

    def __init__(self, store: DiskStore | RedisStore, codec: str, max_pending_bytes: int, pages: PageCopier,
                 counts: TierCounts, transfer_stats: TransferStats, defer_s: float = 0.0) -> None:
        """`defer_s`: how long at most its writes yield to the engine's steps (`ChunkWriter`)."""
        self.storage = store
        self.codec = codec
        self.counts = counts
        self._pages = pages
        self._geometry = pages.geometry
        self.writer = ChunkWriter(self.tier, store, codec, max_pending_bytes, transfer_stats, defer_s)

    @property
    def failure(self) -> str | None:
        """Why its store is not used any more (None: it is)."""
        return self.writer.failure

    def key(self, block_hash: bytes) -> bytes | None:
        raise NotImplementedError

    def _holds(self, key: bytes) -> bool:
        """Stored or on its way, as far as this host can tell without asking much."""
        raise NotImplementedError

    def _get(self, key: bytes, between: Between = no_pause) -> Buffer | None:
        """The value under `key` as stored, None when it is not there (or the store failed); `between`: called
        between slices of the read's work (storage/codecs.py)."""
        raise NotImplementedError

    def _found(self, key: bytes) -> None:
        """A value under `key` was read and passed its checks."""

    # -- loading -------------------------------------------------------------------------------

    def fetch(self, span: ChunkSpan) -> memoryview | None:
        """The chunk's decoded payload, checked; None when it is gone or bad (then quarantined)."""
        key = self.key(span.last_hash)
        value = self._get(key, BACKGROUND_WORK.pace) if key is not None else None
        if value is None:
            return None
        try:
            chunk = decode_frame(value, span.identity(self._geometry), BACKGROUND_WORK.pace)
        except CorruptValueError as e:
            self.quarantine(key, e.check, str(e))
            return None
        self._found(key)
        return writable(chunk.payload)

    def quarantine(self, key: bytes, check: str, reason: str) -> None:
        self.counts.corrupt += 1
        log.warning("a %s-tier KV chunk failed its %s check: dropped, recomputed instead", self.tier, check)
        self.writer.quarantine(key, reason)

    # -- storing -------------------------------------------------------------------------------

    def admit(self, block_hash: bytes, nbytes: int, drop: bool = True) -> Admission:
        key = self.key(block_hash)
        if key is None:
            return Admission.OFF
        if self._holds(key):
            return Admission.HELD
        if self.writer.has_room(nbytes):
            return Admission.TAKE
        if drop:
            self.writer.note_dropped()
        return Admission.FULL

    def store(self, block_hash: bytes, identity: ChunkIdentity, chunk: DeviceChunk, cataloged: bool = False) -> None:
        """Queues the chunk for the writer (one transaction or round trip per chunk: chunks are megabytes)."""
        key = self.key(block_hash)
        self.writer.submit(key, identity, chunk.copy(), cataloged=cataloged)
        self._found(key)

    def delete(self, block_hashes: Sequence[bytes]) -> None:
        keys = [k for k in map(self.key, block_hashes) if k is not None]
        if keys:
            self._forget(keys)
            self.writer.delete(keys)

    def _forget(self, keys: Sequence[bytes]) -> None:
        """These keys are being deleted."""

    # -- lifetime and reports ------------------------------------------------------------------

    def stats(self, unhealthy: str | None = None) -> TierStats:
        """`unhealthy` says why it is not usable when its store itself is fine."""
        return writer_stats(self.tier, self.storage.stats(), self.writer, self.counts, unhealthy)

    def wait(self) -> None:
        self.writer.wait()
