"""The tier manager: saves device pages below as chunks, finds a prompt's stored chunks, loads them back.

    device pages --save--> host slab   raw frames, on the calling thread (a memory copy)
                      \\-->  disk        zstd-planes frames, encoded and committed by the DiskWriter thread
    host / disk  --load--> fresh device pages, on the engine thread (synchronous in this slice)

Every value is a kv_frame, host ones too (raw codec): a load compares its
geometry, namespace, block hashes and token ids with the chunk the prompt
asks for, so a hash collision or a damaged value is a miss, never wrong KV.
A bad disk value is quarantined, a bad host value dropped.

Keys are `Epoch.key(hash of the chunk's last page)`; `chunk.py` has the
scheme. Either store may be absent (turned off, or the disk store could not
open): the manager then works with the other, and says why in its stats.
It is called from the engine thread, or from the event loop between steps;
only the DiskWriter's thread runs beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.host_store import HostStore
from kvtierd.storage.kv_frame import ChunkIdentity, decode_frame, encode_frame, frame_nbytes
from kvtierd.storage.store_errors import CorruptValueError, StoreUnavailableError
from kvtierd.tiers.chunk import ChunkCopy, ChunkSpan, FoundChunk
from kvtierd.tiers.config import TierConfig
from kvtierd.tiers.disk_writer import DiskWriter
from kvtierd.tiers.epoch import Epoch

log = logging.getLogger(__name__)

HOST_CODEC = "raw"  # host copies must be fast; RAM is the budget, not the ratio
MAX_HASH_BYTES = 32  # the longest block hash (sha256): host slots fit a chunk of any hash function


@dataclass(slots=True)
class TierCounts:
    hits: int = 0  # chunks loaded into the device
    hit_tokens: int = 0  # prompt tokens those loads served
    writes: int = 0  # chunks stored (the host's; the disk writer counts its own)
    corrupt: int = 0  # values that failed their checks (never served)


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str  # "host" or "disk"
    enabled: bool  # the store is there (not turned off, and it opened)
    healthy: bool
    reason: str | None  # why it is off or unhealthy
    capacity_bytes: int
    used_bytes: int
    entries: int
    hits: int
    hit_tokens: int
    writes: int
    pending_writes: int  # disk: chunks copied out, not yet committed
    dropped_writes: int  # disk: chunks not written (queue full or store failed)
    evictions: int  # values the store dropped for room
    corrupt: int
    pinned: bool  # host: page-locked memory


class TierManager:
    def __init__(self, config: TierConfig, device: DeviceKVPool) -> None:
        self.config = config
        self.chunk_pages = config.chunk_pages
        self._device = device
        self._geometry = device.geometry
        self.host: HostStore | None = None
        self.host_reason: str | None = None
        if not config.host_bytes:
            self.host_reason = "off: host_bytes is 0"
        else:
            try:
                self.host = HostStore(config.host_bytes, self._slot_bytes())
            except ValueError as e:  # a budget under one chunk
                self.host_reason = str(e)
                log.warning("serving without the host KV tier: %s", e)
        self.disk: DiskStore | None = None
        self.disk_reason: str | None = None
        self._writer: DiskWriter | None = None
        if not config.disk_bytes or config.disk_path is None:
            self.disk_reason = "off: disk_bytes is 0" if not config.disk_bytes else "off: no directory given"
        else:
            try:
                self.disk = DiskStore(config.disk_path, map_size=config.disk_bytes)
                self._writer = DiskWriter(self.disk, config.disk_codec, config.max_pending_disk_bytes)
            except StoreUnavailableError as e:
                self.disk_reason = str(e)
                log.warning("serving without the disk KV tier: %s", e)
        self.epoch = Epoch(config.disk_path if self.disk is not None else None)
        self.counts = {"host": TierCounts(), "disk": TierCounts()}

    @property
    def has_disk(self) -> bool:
        return self._writer is not None and self._writer.failure is None

    # -- finding and loading -----------------------------------------------------------------

    def lookup(self, namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int],
               start: int) -> list[FoundChunk]:
        """The stored chunks that continue a chain whose first `start` pages are on the device, in order.

        `block_hashes` are the hashes of the prompt's full pages from its chain's start, `token_ids`
        its tokens. The first chunk may begin before `start` (chunks are aligned): loading skips the
        pages the device has."""
        stores = self._stores()
        if not stores:
            return []
        n, m = self.chunk_pages, len(block_hashes)
        pos = start - start % n
        ends = range(pos + n, m + 1, n)
        keys = [self.epoch.key(block_hashes[e - 1]) for e in ends]
        found: list[FoundChunk] = []
        i = 0
        while i < len(keys):  # whole chunks: one call per tier and run
            for tier, contains in stores:
                k = contains(keys[i:])
                if k:
                    found += [FoundChunk(tier, self._span(namespace, block_hashes, token_ids, e - n, e))
                              for e in ends[i : i + k]]
                    i += k
                    break
            else:
                break
        pos += i * n
        # Then the chain's partial last chunk, if one was stored here: the longest first.
        for end in range(min(pos + n - 1, m), max(pos, start), -1):
            key = [self.epoch.key(block_hashes[end - 1])]
            tier = next((t for t, contains in stores if contains(key)), None)
            if tier is not None:
                found.append(FoundChunk(tier, self._span(namespace, block_hashes, token_ids, pos, end)))
                break
        return found

    def load(self, found: FoundChunk, skip: int, block_ids: Sequence[int]) -> bool:
        """Copies pages `skip`.. of a found chunk into the device pages `block_ids`. False when the value
        is gone (evicted since the lookup) or fails its checks."""
        span, tier = found.span, found.tier
        key = self.epoch.key(span.last_hash)
        if tier == "host":
            value = self.host.get_many([key])[0] if self.host is not None else None
        else:
            value = self._writer.call(lambda: self.disk.get_many([key])[0], None) if self.has_disk else None
        if value is None:
            return False
        try:
            chunk = decode_frame(value, span.identity(self._geometry))
        except CorruptValueError as e:
            self.counts[tier].corrupt += 1
            log.warning("a %s-tier KV chunk failed its %s check: dropped, recomputed instead", tier, e.check)
            if tier == "host":
                self.host.delete_many([key])
            else:
                self._writer.quarantine(key, str(e))
            return False
        g = self._geometry
        kv = torch.frombuffer(bytearray(chunk.payload), dtype=torch.uint8).view(g.dtype).view(self._shape(span.num_pages))
        self._scatter(kv[:, :, skip:], block_ids)
        counts = self.counts[tier]
        counts.hits += 1
        counts.hit_tokens += len(block_ids) * g.block_size
        return True

    # -- saving --------------------------------------------------------------------------------

    def demote(self, copies: Sequence[ChunkCopy]) -> None:
        """Saves chunks of pages evicted from the device: each to the host tier, and to disk those the
        admission policy takes. Call before the pages are written again; returns once they may be."""
        take_all = self.config.disk_admission == "all"
        self._save(copies, host=True, disk=lambda c: take_all or c.hits > 0)

    def write_through(self, copies: Sequence[ChunkCopy], wait_for_room: bool = False) -> bool:
        """Saves chunks to the disk tier (a session's finished turn, the shutdown flush), to outlive the
        process. The copy out of the device happens now; encoding and the commit on the writer thread.

        When the writer's queue is full, the rest are dropped (counted); with `wait_for_room` they are
        left instead and False returned: call `wait()` (off the event loop) and again."""
        if not self.has_disk:
            return True
        return self._save(copies, host=False, disk=lambda c: True, stop_when_full=wait_for_room)

    def _save(self, copies: Sequence[ChunkCopy], host: bool, disk: Callable[[ChunkCopy], bool],
              stop_when_full: bool = False) -> bool:
        done = True
        for c in copies:
            key = self.epoch.key(c.span.last_hash)
            to_host = host and self.host is not None and not self.host.contains_prefix([key])
            to_disk = self.has_disk and disk(c) and not self._writer.has(key)
            if to_disk and not self._writer.has_room(len(c.block_ids) * self._geometry.bytes_per_block):
                to_disk = False
                if stop_when_full:
                    done = False
                    break
                self._writer.note_dropped()
            if not (to_host or to_disk):
                continue
            kv = self._gather(c.block_ids)
            identity = c.span.identity(self._geometry)
            if to_host:
                self.host.put_many([(key, encode_frame(identity, _bytes(kv), codec=HOST_CODEC))])
                self.counts["host"].writes += 1
            if to_disk:
                self._writer.submit(key, identity, kv)  # one transaction per chunk: chunks are megabytes
        return done

    # -- forgetting ----------------------------------------------------------------------------

    def forget(self, block_hashes: Sequence[bytes]) -> None:
        """Drops the chunks keyed by these pages' hashes (a session's own pages: every chunk of its chain
        past them is keyed by one of them)."""
        keys = [self.epoch.key(h) for h in block_hashes]
        if keys and self.host is not None:
            self.host.delete_many(keys)
        if keys and self.has_disk:
            self._writer.delete(keys)

    def invalidate_all(self) -> None:
        """Makes everything stored so far unreachable (a new epoch); the LRU reclaims its room."""
        value = self.epoch.renew()
        if self._writer is not None:
            self._writer.run(lambda: self.epoch.save(value))

    # -- lifetime and reports ------------------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until the disk writes queued so far are committed (never call it on the event loop)."""
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self.disk is not None:
            try:
                self.disk.close()
            except StoreUnavailableError:
                pass  # already failed; nothing left to save
        if self.host is not None:
            self.host.close()

    def stats(self) -> list[TierStats]:
        return [self._host_stats(), self._disk_stats()]

    def _host_stats(self) -> TierStats:
        c = self.counts["host"]
        if self.host is None:
            return _off("host", self.host_reason, c)
        s = self.host.stats()
        return TierStats("host", True, s.healthy, s.reason, s.capacity_bytes, s.bytes_used, s.num_entries,
                         c.hits, c.hit_tokens, c.writes, 0, 0, s.num_evictions, c.corrupt, s.pinned)

    def _disk_stats(self) -> TierStats:
        c = self.counts["disk"]
        if self.disk is None or self._writer is None:
            return _off("disk", self.disk_reason, c)
        w = self._writer
        s = self.disk.stats()
        healthy = s.healthy and w.failure is None
        return TierStats("disk", True, healthy, w.failure or s.reason, s.capacity_bytes, s.bytes_used, s.num_entries,
                         c.hits, c.hit_tokens, w.num_written, w.num_pending, w.num_dropped, s.num_evictions,
                         s.num_corrupt, False)

    # -- internals -----------------------------------------------------------------------------

    def _stores(self) -> list[tuple[str, Callable[[Sequence[bytes]], int]]]:
        """(tier, contains_prefix) of each usable store, host first: the faster one serves a chunk both hold."""
        stores: list[tuple[str, Callable[[Sequence[bytes]], int]]] = []
        if self.host is not None:
            stores.append(("host", self.host.contains_prefix))
        if self.has_disk:
            disk, writer = self.disk, self._writer
            stores.append(("disk", lambda keys: int(writer.call(lambda: disk.contains_prefix(keys), 0))))
        return stores

    def _span(self, namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int], start: int,
              end: int) -> ChunkSpan:
        bs = self._geometry.block_size
        return ChunkSpan(namespace, start, tuple(block_hashes[start:end]), tuple(token_ids[start * bs : end * bs]))

    def _shape(self, num_pages: int) -> tuple[int, ...]:
        g = self._geometry
        return (g.num_layers, 2, num_pages, g.block_size, g.num_kv_heads, g.head_dim)

    def _slot_bytes(self) -> int:
        """A host slot holds the largest frame: a whole chunk with the longest hashes and namespace."""
        g, n = self._geometry, self.chunk_pages
        widest = ChunkIdentity(g, bytes(MAX_HASH_BYTES), (bytes(MAX_HASH_BYTES),) * n, (0,) * (n * g.block_size))
        return frame_nbytes(widest, HOST_CODEC, widest.payload_nbytes)

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The pages' K and V, `[layers, 2, pages, block_size, kv_heads, head_dim]`, copied to CPU memory."""
        dev = self._device
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=dev.device)
        out = torch.empty(self._shape(len(block_ids)), dtype=self._geometry.dtype, device=dev.device)
        for layer, (k, v) in enumerate(dev.kv_caches):
            torch.index_select(k, 0, idx, out=out[layer, 0])
            torch.index_select(v, 0, idx, out=out[layer, 1])
        return out.cpu()

    def _scatter(self, kv: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Writes `[layers, 2, pages, ...]` K and V into the device pages `block_ids`."""
        dev = self._device
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=dev.device)
        kv = kv.to(dev.device)
        for layer, (k, v) in enumerate(dev.kv_caches):
            k.index_copy_(0, idx, kv[layer, 0])
            v.index_copy_(0, idx, kv[layer, 1])


def _bytes(kv: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy())


def _off(name: str, reason: str | None, c: TierCounts) -> TierStats:
    return TierStats(name, False, False, reason, 0, 0, 0, c.hits, c.hit_tokens, c.writes, 0, 0, 0, c.corrupt, False)
