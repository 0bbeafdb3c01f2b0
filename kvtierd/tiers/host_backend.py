"""The host tier: raw frames in slots of the host slab (`storage/host_store.py`), written and read on the
caller's thread (a memory copy each way).

A store gathers the device pages straight into a slot (one copy) and puts the
frame's head before them with the payload's checksum; a load copies each layer
from the slot into the device pages and hashes the bytes it just read (still in
cache), and the pages count only once the checksum matched. A bad value is
dropped. Keys are the local epoch's (`epoch.py`), shared with the disk tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xxhash

from kvtierd.storage.host_store import ALIGN, HostStore
from kvtierd.storage.kv_frame import ChunkIdentity, frame_head, frame_nbytes
from kvtierd.tiers.backend import Admission
from kvtierd.tiers.chunk import ChunkSpan
from kvtierd.tiers.device_chunk import DeviceChunk
from kvtierd.tiers.epoch import Epoch
from kvtierd.tiers.frame_pages import RAW_CODEC, scatter_frame
from kvtierd.tiers.page_copy import PageCopier
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_stats import TierCounts, TierStats, host_stats
from kvtierd.tiers.transfer import TransferStats

log = logging.getLogger(__name__)

MAX_HASH_BYTES = 32  # the longest block hash (sha256): host slots fit a chunk of any hash function


class HostBackend:
    tier = Tier.HOST

    def __init__(self, capacity_bytes: int, chunk_pages: int, pages: PageCopier, epoch: Epoch,
                 counts: TierCounts, transfer_stats: TransferStats) -> None:
        """Raises ValueError when `capacity_bytes` is under one chunk."""
        self._pages = pages
        self.geometry = pages.geometry
        self._epoch = epoch
        self.counts = counts
        self._transfer_stats = transfer_stats
        self.storage = HostStore(capacity_bytes, self._slot_bytes(chunk_pages))

    # -- finding and loading -----------------------------------------------------------------

    def usable(self) -> bool:
        return True

    def key(self, block_hash: bytes) -> bytes:
        return self._epoch.key(block_hash)

    def has(self, key: bytes) -> bool:
        return self.storage.contains_prefix([key]) == 1

    def holds_each(self, block_hashes: Sequence[bytes]) -> list[bool]:
        return self.storage.contains_each([self._epoch.key(h) for h in block_hashes])

    def load(self, span: ChunkSpan, skip: int, block_ids: Sequence[int]) -> bool:
        key, identity = self.key(span.last_hash), span.identity(self.geometry)
        outcome = self.storage.read(key, lambda value: scatter_frame(self._pages, value, identity, skip, block_ids))
        if outcome is None:  # evicted since the lookup
            return False
        if outcome != "ok":
            self.counts.corrupt += 1
            log.warning("a host-tier KV chunk failed its %s check: dropped, recomputed instead", outcome)
            self.storage.delete_many([key])
            return False
        return True

    # -- storing -----------------------------------------------------------------------------

    def admit(self, block_hash: bytes, nbytes: int, drop: bool = True) -> Admission:
        return Admission.HELD if self.has(self.key(block_hash)) else Admission.TAKE  # the LRU makes room

    def store(self, block_hash: bytes, identity: ChunkIdentity, chunk: DeviceChunk, cataloged: bool = False) -> None:
        t0 = time.perf_counter()
        self.put(self.key(block_hash), identity, chunk.fill)
        self._transfer_stats.observe(self.tier, "store", time.perf_counter() - t0, identity.payload_nbytes)
        self.counts.writes += 1

    def store_now(self, key: bytes, identity: ChunkIdentity, block_ids: Sequence[int]) -> None:
        self.put(key, identity, lambda out: self._pages.gather_into(out, block_ids))

    def put(self, key: bytes, identity: ChunkIdentity, fill: Callable[[torch.Tensor], None]) -> None:
        """Writes a raw frame into a slot: `fill` puts the KV in place (`[layers, 2, pages, ...]`), then the
        head goes before it with the payload's checksum."""
        nbytes = identity.payload_nbytes
        head_len = len(frame_head(identity, RAW_CODEC, nbytes, 0))
        shape = self._pages.shape(identity.num_pages)

        def write(value: torch.Tensor) -> None:
            payload = value[head_len:]
            fill(payload.view(self.geometry.dtype).view(shape))
            checksum = xxhash.xxh3_64_intdigest(payload.numpy())
            value.numpy()[:head_len] = np.frombuffer(frame_head(identity, RAW_CODEC, nbytes, checksum), np.uint8)

        self.storage.write(key, head_len + nbytes, write, align_at=head_len, owner=identity.namespace)

    def read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        pass  # a load reads memory: nothing to wait for

    def drop_read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        pass

    # -- forgetting and pins -----------------------------------------------------------------

    def delete(self, block_hashes: Sequence[bytes]) -> None:
        self.storage.delete_many([self.key(h) for h in block_hashes])

    def invalidate(self) -> None:
        pass  # its keys mix in the local epoch, which the manager renewed: the LRU reclaims the old ones

    @property
    def capacity_bytes(self) -> int:
        return self.storage.stats().capacity_bytes

    @property
    def failure(self) -> str | None:
        return None

    def pin(self, keys: Sequence[bytes]) -> int:
        return self.storage.pin(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        self.storage.unpin(keys)

    # -- lifetime and reports ----------------------------------------------------------------

    def stats(self) -> TierStats:
        return host_stats(self.storage, self.counts)

    def wait(self) -> None:
        pass  # every store is done when `store` returns

    def close(self) -> None:
        self.storage.close()

    def _slot_bytes(self, chunk_pages: int) -> int:
        """A slot holds the largest frame: a whole chunk with the longest hashes and namespace."""
        g, n = self.geometry, chunk_pages
        widest = ChunkIdentity(g, bytes(MAX_HASH_BYTES), (bytes(MAX_HASH_BYTES),) * n, (0,) * (n * g.block_size))
        return frame_nbytes(widest, RAW_CODEC, widest.payload_nbytes) + ALIGN - 1  # room to align the payload
