"""The disk tier: frames in the tier's disk codec in the LMDB store (`storage/disk_store.py`), encoded and
committed by its writer thread, read on the caller's thread (LMDB reads take no lock). Keys are the local
epoch's (`epoch.py`), which lives in the store's directory; a failed store is remembered and the tier is
then off until a restart."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtierd.storage.codecs import Between, Buffer, no_pause
from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.kv_frame import ChunkIdentity, claimed_identity, decode_frame, encode_frame
from kvtierd.storage.store_errors import CorruptValueError, StoreUnavailableError
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.chunk import ChunkSpan
from kvtierd.tiers.epoch import Epoch
from kvtierd.tiers.frame_pages import scatter_frame, tensor_bytes, writable
from kvtierd.tiers.page_copy import PageCopier
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_stats import Reconciliation, TierCounts
from kvtierd.tiers.transfer import TransferStats
from kvtierd.tiers.writer_backend import WriterBackend


class DiskBackend(WriterBackend):
    tier = Tier.DISK

    def __init__(self, store: DiskStore, codec: str, max_pending_bytes: int, pages: PageCopier, epoch: Epoch,
                 counts: TierCounts, transfer_stats: TransferStats, defer_s: float = 0.0) -> None:
        super().__init__(store, codec, max_pending_bytes, pages, counts, transfer_stats, defer_s)
        self._epoch = epoch

    def usable(self) -> bool:
        return self.writer.failure is None

    def key(self, block_hash: bytes) -> bytes | None:
        return self._epoch.key(block_hash) if self.usable() else None

    def has(self, key: bytes) -> bool:
        return bool(self.writer.call(lambda: self.storage.contains_prefix([key]) == 1, False))

    def holds_each(self, block_hashes: Sequence[bytes]) -> list[bool]:
        keys = [self._epoch.key(h) for h in block_hashes]
        return self.writer.call(lambda: self.storage.contains_each(keys), [False] * len(keys))

    def _holds(self, key: bytes) -> bool:
        return self.writer.has(key)

    def _get(self, key: bytes, between: Between = no_pause) -> Buffer | None:
        return self.writer.call(lambda: self.storage.get_many([key])[0], None)

    def load(self, span: ChunkSpan, skip: int, block_ids: Sequence[int]) -> bool:
        """Reads the value into the store's buffer (one read of the file; while the load yields to steps, a
        cold value's read goes on beside them: it holds no core) and copies or decodes it from there into the
        pages."""
        key = self.key(span.last_hash)
        if key is None:
            return False
        identity = span.identity(self._geometry)

        def scatter(value: memoryview) -> str:
            return scatter_frame(self._pages, torch.frombuffer(value, dtype=torch.uint8), identity, skip, block_ids,
                                 decode=True)

        waiting = BACKGROUND_WORK.unsliced if BACKGROUND_WORK.pacing() else None
        outcome = self.writer.call(lambda: self.storage.read(key, scatter, waiting), None)
        if outcome is None:  # gone since the lookup, or the disk failed
            return False
        if outcome != "ok":
            self.quarantine(key, outcome, f"failed its {outcome} check")
            return False
        return True

    def read_claimed(self, key: bytes) -> tuple[ChunkIdentity, memoryview] | None:
        """The chunk under `key` as its frame names it, when that frame is whole and is what `key` names under
        the current epoch (not an earlier epoch's value, nor another chain's): for warming the host tier."""
        value = self._get(key)
        if value is None:
            return None
        try:
            identity = claimed_identity(value, self._geometry)
            if self._epoch.key(identity.block_hashes[-1]) != key:
                return None
            return identity, writable(decode_frame(value, identity).payload)
        except CorruptValueError as e:
            self.quarantine(key, e.check, str(e))
            return None

    def store_now(self, key: bytes, identity: ChunkIdentity, block_ids: Sequence[int]) -> None:
        """On this thread, not the writer's."""
        frame = encode_frame(identity, tensor_bytes(self._pages.gather(block_ids)), codec=self.codec)
        self.writer.call(lambda: self.storage.put_many([(key, frame)], owner=identity.namespace), False)

    def read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        pass  # a disk read is no round trip to wait out: it goes as fast when its load starts

    def drop_read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        pass

    @property
    def capacity_bytes(self) -> int:
        return self.storage.stats().capacity_bytes

    def pin(self, keys: Sequence[bytes]) -> int:
        return self.storage.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self.storage.unpin(keys)

    def invalidate(self) -> None:
        value = self._epoch.value
        self.writer.run(lambda: self._epoch.save(value))  # the epoch's file lives beside the store

    def reconcile(self, cataloged: set[bytes]) -> Reconciliation:
        """Deletes the values a session's turn wrote that the SQL catalog (`cataloged`) no longer names, and
        returns the cataloged keys it lacks. On the writer's thread, after the writes queued before it."""

        def settle() -> Reconciliation:
            orphans = [key for key in self.storage.cataloged_keys() if key not in cataloged]
            deleted = self.storage.delete_many(orphans) if orphans else 0
            missing = tuple(key for key in cataloged if not self.storage.contains_prefix([key]))
            return Reconciliation(deleted, missing)

        return self.writer.run(settle).result()

    def close(self) -> None:
        self.writer.close()
        try:
            self.storage.close()
        except StoreUnavailableError:
            pass  # already failed; nothing left to save
