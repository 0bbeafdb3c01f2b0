"""The tier manager: saves device pages below as chunks, finds a prompt's stored chunks, loads them back.

    device pages --save--> host slab   raw frames, gathered straight into a slot (one copy)
                      \\-->  disk        frames in the disk codec, encoded and committed by the disk's writer thread
                      \\-->  remote      zstd-planes frames, sealed and sent by the remote's writer thread
    host / disk / remote --load--> fresh device pages, on a transfer worker (`transfer.py`)
    disk / remote --prefetch--> host slab, on the prefetch thread, as soon as a request arrives
    disk --warm--> host slab, on the prefetch thread, at startup (recent sessions' chunks)

A host load copies each layer from the slot into the device pages and hashes
the bytes it just read (still in cache) for the checksum; the pages are
indexed only once the checksum matched. Every load is timed for the restore
planner (`restore_planner.py`), which decides per request whether loading
beats recomputing.

Every value is a kv_frame, host ones too (raw codec): a load compares its
geometry, namespace, block hashes and token ids with the chunk the prompt
asks for, so a hash collision or a damaged value is a miss, never wrong KV.
A bad disk or remote value is quarantined, a bad host value dropped.

Keys are `Epoch.key(hash of the chunk's last page)` on host and disk;
`chunk.py` has the scheme. The remote tier is shared by hosts, so its keys
mix in the fleet's epoch instead, kept in Redis: an invalidation on one host
starts a new fleet epoch, which the others read within `FLEET_EPOCH_REFRESH_S`.
Any store may be absent (turned off, or it could not open): the manager then
works with the others, and says why in its stats. It is called from the
engine thread, or from the event loop between steps; the writers', the
prefetch and the transfer threads run beside it (`load` runs on the latter).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvtierd.storage.codecs import Buffer
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.host_store import HostStore
from kvtierd.storage.host_store import ALIGN
from kvtierd.storage.kv_frame import (ChunkIdentity, check_frame_head, claimed_identity, decode_frame,
                                      encode_frame, frame_head, frame_nbytes)
from kvtierd.storage.redis_keyspace import RedisKeyspace
from kvtierd.storage.redis_store import RedisStore
from kvtierd.storage.store_errors import CorruptValueError, StoreUnavailableError
from kvtierd.tiers.chunk import ChunkCopy, ChunkSpan, FoundChunk
from kvtierd.tiers.chunk_writer import ChunkWriter
from kvtierd.tiers.config import TierConfig, resolve_codec
from kvtierd.tiers.epoch import Epoch
from kvtierd.tiers.fleet_epoch import FleetEpoch
from kvtierd.tiers.page_copy import PageCopier
from kvtierd.tiers.restore_planner import RestorePlanner
from kvtierd.tiers.store_name import disk_store_name
from kvtierd.tiers.transfer import TransferQueue, TransferStats
from kvtierd.tiers.tier_stats import Reconciliation, TierCounts, TierStats, host_stats, off_stats, writer_stats

log = logging.getLogger(__name__)

HOST_CODEC = "raw"  # host copies must be fast; RAM is the budget, not the ratio
PIN_TIERS = ("host", "disk")


class TierPinError(ValueError):
    """A pin below the device that cannot be made as asked (its tier is off, or over its pin budget)."""


@dataclass(frozen=True, slots=True)
class TierPin:
    tier: str  # "host" or "disk"
    keys: tuple[bytes, ...]  # the chunks it holds
    nbytes: int  # their KV bytes: what counts against the tier's pin budget
MAX_PREFETCHED_ORIGINS = 4096  # host keys whose origin tier is remembered until a load uses them
MAX_HASH_BYTES = 32  # the longest block hash (sha256): host slots fit a chunk of any hash function


class TierManager:
    def __init__(self, config: TierConfig, device: DeviceKVPool, model_fingerprint: str = "") -> None:
        self.config = config
        self.chunk_pages = config.chunk_pages
        self._geometry = device.geometry
        self.disk_codec = resolve_codec(config.disk_codec, self._geometry.dtype, "disk")
        self._pages = PageCopier(device)
        self.transfer_stats = TransferStats()  # times and bytes of every load and store, by tier
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
        self._writer: ChunkWriter | None = None
        if not config.disk_bytes or config.disk_path is None:
            self.disk_reason = "off: disk_bytes is 0" if not config.disk_bytes else "off: no directory given"
        else:
            try:
                self.disk = DiskStore(config.disk_path, map_size=config.disk_bytes)
                self._writer = ChunkWriter("disk", self.disk, self.disk_codec, config.max_pending_disk_bytes,
                                           self.transfer_stats)
            except StoreUnavailableError as e:
                self.disk_reason = str(e)
                log.warning("serving without the disk KV tier: %s", e)
        self.epoch = Epoch(config.disk_path if self.disk is not None else None)
        # The disk store's name in the SQL chunk catalog (None: no disk, or its id cannot be kept).
        self.store_name = disk_store_name(config.disk_path) if self.disk is not None else None
        self.remote: RedisStore | None = None
        self._remote_writer: ChunkWriter | None = None
        self._fleet_epoch: FleetEpoch | None = None
        if config.remote is not None:
            r = config.remote
            keyspace = RedisKeyspace(r.fleet, model_fingerprint, self._geometry, config.chunk_pages)
            self.remote = RedisStore(r.url, keyspace, r.secret, ttl_s=r.ttl_s, connect_timeout_ms=r.connect_timeout_ms,
                                     op_timeout_ms=r.op_timeout_ms)
            self._remote_writer = ChunkWriter("remote", self.remote, resolve_codec(r.codec, self._geometry.dtype, "remote"),
                                              config.max_pending_disk_bytes, self.transfer_stats)
            self._fleet_epoch = FleetEpoch(self.remote)
        self.counts = {"host": TierCounts(), "disk": TierCounts(), "remote": TierCounts()}
        self.planner = RestorePlanner()
        # Prefetches run on a thread of their own: disk reads and Redis round trips never wait in the engine's step.
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtierd-prefetch")
        self._prefetch_lock = threading.Lock()
        self._prefetching: dict[bytes, Future] = {}  # host key -> its copy up, until done
        # host key -> the tier a prefetch copied it from, until a load uses it: that load counts for that tier
        self._prefetched_from: OrderedDict[bytes, str] = OrderedDict()
        self.pins: dict[str, TierPin] = {}  # pin id -> what it holds below the device
        # Loads run here, off the engine's step: the cache manager submits them and collects them between steps.
        self.transfers = TransferQueue(self.load, self.bytes_per_page, self.transfer_stats)
        # Stores' copies out of the device, off the step: one thread, in submission order.
        self._store_copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtierd-store-copy")

    @property
    def bytes_per_page(self) -> int:
        return self._geometry.bytes_per_block

    @property
    def has_disk(self) -> bool:
        return self._writer is not None and self._writer.failure is None

    @property
    def can_write_through(self) -> bool:
        """A tier that outlives this process (disk) or this host (remote) is there."""
        return self.has_disk or self.remote is not None

    @property
    def shares_every_request(self) -> bool:
        """Finished requests' chunks go to the fleet, not only sessions'."""
        return self.remote is not None and self.config.remote.admission == "all"

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
        last_hashes = [block_hashes[e - 1] for e in ends]
        found: list[FoundChunk] = []
        i = 0
        while i < len(last_hashes):  # whole chunks: one call per tier and run
            for tier, contains in stores:
                k = contains(last_hashes[i:])
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
            tier = next((t for t, contains in stores if contains([block_hashes[end - 1]])), None)
            if tier is not None:
                found.append(FoundChunk(tier, self._span(namespace, block_hashes, token_ids, pos, end)))
                break
        return found

    def load(self, found: FoundChunk, skip: int, block_ids: Sequence[int]) -> str | None:
        """Copies pages `skip`.. of a found chunk into the device pages `block_ids` (on a transfer worker: see
        `transfers`); returns the tier it counts for (where it was found, or where a prefetch for this request copied it from). None when the value is
        gone (evicted since the lookup) or fails its checks."""
        span, tier = found.span, found.tier
        key = self._key(tier, span.last_hash)
        if key is None:
            return None
        t0 = time.perf_counter()
        served, host_key = tier, self.epoch.key(span.last_hash)
        if tier != "host":
            self._await_prefetch(host_key)
            if self.host is not None and self.host.contains_prefix([host_key]):
                served, key = "host", host_key  # prefetched meanwhile: the nearest copy
        loaded = self._load_host(key, span, skip, block_ids) if served == "host" else \
            self._load_below(tier, key, span, skip, block_ids)
        if loaded:
            nbytes = len(block_ids) * self._geometry.bytes_per_block
            self.planner.observe_load(served, nbytes, time.perf_counter() - t0)
            with self._prefetch_lock:  # a prefetched copy counts for the tier that had the chunk
                tier = self._prefetched_from.pop(host_key, tier)
            counts = self.counts[tier]
            counts.hits += 1
            counts.hit_tokens += len(block_ids) * self._geometry.block_size
            return tier
        return None

    def _load_host(self, key: bytes, span: ChunkSpan, skip: int, block_ids: Sequence[int]) -> bool:
        if self.host is None:
            return False
        identity = span.identity(self._geometry)
        outcome = self.host.read(key, lambda value: self._scatter_frame(value, identity, skip, block_ids))
        if outcome is None:  # evicted since the lookup
            return False
        if outcome != "ok":
            self.counts["host"].corrupt += 1
            log.warning("a host-tier KV chunk failed its %s check: dropped, recomputed instead", outcome)
            self.host.delete_many([key])
            return False
        return True

    def _load_below(self, tier: str, key: bytes, span: ChunkSpan, skip: int, block_ids: Sequence[int]) -> bool:
        if tier == "disk":
            return self._load_disk(key, span, skip, block_ids)
        chunk = self._fetch(tier, key, span)
        if chunk is None:
            return False
        kv = torch.frombuffer(chunk, dtype=torch.uint8).view(self._geometry.dtype).view(self._pages.shape(span.num_pages))
        self._pages.scatter(kv, skip, block_ids)
        if tier == "remote":
            self._fleet_epoch.remember(key)  # the fleet has it: no need to send it back
        return True

    def _load_disk(self, key: bytes, span: ChunkSpan, skip: int, block_ids: Sequence[int]) -> bool:
        """Reads the value into the disk store's scratch buffer (one read of the file) and copies or decodes
        it from there into the pages."""
        if not self.has_disk:
            return False
        identity = span.identity(self._geometry)

        def scatter(value: memoryview) -> str:
            return self._scatter_frame(torch.frombuffer(value, dtype=torch.uint8), identity, skip, block_ids,
                                       decode=True)

        outcome = self._writer.call(lambda: self.disk.read(key, scatter), None)
        if outcome is None:  # gone since the lookup, or the disk failed
            return False
        if outcome != "ok":
            self.counts["disk"].corrupt += 1
            log.warning("a disk-tier KV chunk failed its %s check: dropped, recomputed instead", outcome)
            self._writer.quarantine(key, f"failed its {outcome} check")
            return False
        return True

    def _scatter_frame(self, value: torch.Tensor, identity: ChunkIdentity, skip: int, block_ids: Sequence[int],
                       decode: bool = False) -> str:
        """Checks a frame (a flat uint8 tensor) and writes its pages `skip`.. into `block_ids`: "ok", else the
        failed check's name. A raw payload is copied straight from `value` and hashed layer by layer right
        after the copy read it (one pass); another codec is decoded first, when `decode` allows it."""
        try:
            frame = check_frame_head(value.numpy(), identity)
        except CorruptValueError as e:
            return e.check
        if frame.codec == HOST_CODEC:  # viewed as bytes: a disk value's payload need not be aligned
            if len(frame.encoded) != identity.payload_nbytes:
                return "payload size"
            payload = value[frame.payload_offset : frame.payload_offset + identity.payload_nbytes]
            checksum = self._pages.scatter(payload.view(self._pages.byte_shape(identity.num_pages)), skip,
                                           block_ids, frame.encoded)
            return "ok" if checksum == frame.checksum else "checksum"
        if not decode:
            return "codec"
        try:
            chunk = decode_frame(value.numpy(), identity)  # checks the payload's checksum itself
        except CorruptValueError as e:
            return e.check
        kv = torch.frombuffer(_writable(chunk.payload), dtype=torch.uint8)
        self._pages.scatter(kv.view(self._pages.byte_shape(identity.num_pages)), skip, block_ids)
        return "ok"

    def _fetch(self, tier: str, key: bytes, span: ChunkSpan) -> memoryview | None:
        """A disk or remote chunk's decoded payload, checked; None when it is gone or bad (then quarantined)."""
        if tier == "disk":
            value = self._writer.call(lambda: self.disk.get_many([key])[0], None) if self.has_disk else None
        else:
            value = self.remote.get_many([key])[0]  # bounded by the store's timeout and circuit breaker
        if value is None:
            return None
        try:
            chunk = decode_frame(value, span.identity(self._geometry))
        except CorruptValueError as e:
            self.counts[tier].corrupt += 1
            log.warning("a %s-tier KV chunk failed its %s check: dropped, recomputed instead", tier, e.check)
            (self._writer if tier == "disk" else self._remote_writer).quarantine(key, str(e))
            return None
        return _writable(chunk.payload)

    # -- prefetching ---------------------------------------------------------------------------

    def prefetch(self, namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int], start: int) -> None:
        """Starts copying up to the host tier the chunks of a chain (from page `start`) that only the disk or
        the fleet holds, so its request finds them in memory when it is scheduled. Returns at once."""
        if self.host is None or (not self.has_disk and self.remote is None):
            return
        self._prefetcher.submit(self._prefetch, namespace, list(block_hashes), list(token_ids), start)

    def _prefetch(self, namespace: bytes, block_hashes: list[bytes], token_ids: list[int], start: int) -> None:
        try:
            for found in self.lookup(namespace, block_hashes, token_ids, start):
                if found.tier == "host":
                    continue
                host_key = self.epoch.key(found.span.last_hash)
                if self.host.contains_prefix([host_key]):
                    continue  # found below only because an earlier chunk of the run is not in memory
                done: Future = Future()
                with self._prefetch_lock:
                    if host_key in self._prefetching:
                        continue
                    self._prefetching[host_key] = done
                try:
                    key = self._key(found.tier, found.span.last_hash)
                    chunk = self._fetch(found.tier, key, found.span) if key is not None else None
                    if chunk is None:
                        break  # the chain stops here: what follows is unreachable anyway
                    self._put_host(host_key, found.span.identity(self._geometry),
                                   lambda out, payload=chunk: _copy_bytes(out, payload))
                    self._note_prefetched(host_key, found.tier)
                    if found.tier == "remote":
                        self._fleet_epoch.remember(key)  # the fleet has it: no need to send it back
                finally:
                    with self._prefetch_lock:
                        del self._prefetching[host_key]
                    done.set_result(None)
        except Exception:  # the executor would swallow it; a failed prefetch only costs a slower load
            log.exception("prefetching KV chunks to the host tier failed")

    def warm(self, keys: Sequence[bytes]) -> Future:
        """Copies these disk chunks up to the host tier, in order, at most as many as it has slots for (the
        last ones given are the most recent in its LRU): the chunks of recently active sessions, so their next
        turns start from memory. One chunk at a time on the prefetch thread, so a request's prefetch never
        waits behind the whole list. The future is done when the last one is."""
        done: Future = Future()
        if self.host is None or not self.has_disk:
            done.set_result(0)
            return done
        todo = list(keys)[-self.host.num_slots :]

        def step(i: int, warmed: int) -> None:
            try:
                while i < len(todo) and self.host.contains_prefix([todo[i]]):
                    i += 1
                if i == len(todo):
                    done.set_result(warmed)
                    return
                warmed += self._warm_one(todo[i])
                self._prefetcher.submit(step, i + 1, warmed)
            except Exception as e:  # the executor would swallow it; a failed warm-up only costs slower loads
                log.exception("warming the host tier from disk failed")
                done.set_exception(e)

        self._prefetcher.submit(step, 0, 0)
        return done

    def _warm_one(self, key: bytes) -> int:
        """One disk chunk into the host tier, its frame checked against its key; 1 if it was copied."""
        value = self._writer.call(lambda: self.disk.get_many([key])[0], None)
        if value is None:
            return 0
        try:
            identity = claimed_identity(value, self._geometry)
            if self.epoch.key(identity.block_hashes[-1]) != key:
                return 0  # an earlier epoch's value, or another chain's: not what the key names now
            payload = _writable(decode_frame(value, identity).payload)
        except CorruptValueError as e:
            self.counts["disk"].corrupt += 1
            log.warning("a disk-tier KV chunk failed its %s check: dropped", e.check)
            self._writer.quarantine(key, str(e))
            return 0
        self._put_host(key, identity, lambda out: _copy_bytes(out, payload))
        self._note_prefetched(key, "disk")
        return 1

    def _note_prefetched(self, host_key: bytes, tier: str) -> None:
        """A chunk copied up to the host tier ahead of its request: a load of it counts for `tier`."""
        self.counts[tier].prefetched += 1
        with self._prefetch_lock:
            self._prefetched_from[host_key] = tier
            while len(self._prefetched_from) > MAX_PREFETCHED_ORIGINS:  # prefetched for requests
                self._prefetched_from.popitem(last=False)  # that never loaded them

    def _await_prefetch(self, host_key: bytes) -> None:
        """Waits for a prefetch of this chunk that is under way: its copy is nearly done, a second read is not."""
        with self._prefetch_lock:
            pending = self._prefetching.get(host_key)
        if pending is not None:
            pending.result()

    # -- saving --------------------------------------------------------------------------------

    def demote(self, copies: Sequence[ChunkCopy]) -> None:
        """Saves chunks of pages evicted from the device: each to the host tier, and to disk and the
        fleet those the disk admission policy takes. Call before the pages are written again; returns
        once they may be."""
        take_all = self.config.disk_admission == "all"

        def admitted(c: ChunkCopy) -> bool:
            return take_all or c.hits > 0

        self._save(copies, host=True, disk=admitted, remote=admitted)

    def save_ahead(self, copies: Sequence[ChunkCopy]) -> int:
        """Saves chunks of idle device pages to the host tier before they are evicted (the free-page
        watermark); their eviction then finds them saved. Returns how many were not there yet."""
        before = self.counts["host"].writes
        self._save(copies, host=True, disk=lambda c: False, remote=lambda c: False)
        return self.counts["host"].writes - before

    def write_turn(self, copies: Sequence[ChunkCopy], session: bool,
                   copied: list[Future] | None = None) -> tuple[bytes, ...]:
        """Saves a finished request's chunks: a session's turn to disk and the fleet, so the session outlives a
        restart, a crash or its host; any other request's prompt to the fleet, when it shares every request.
        The copy out of the device happens now; encoding and storing on the writers' threads (a chunk the
        disk writer has no room for is dropped and counted).

        Returns the disk keys of a session turn's chunks (stored, or queued now and marked cataloged) for the
        SQL catalog to name; the startup reconciliation (`reconcile`) settles what a crash left half done.

        Given `copied`, the copy out of the device is not made now but on the store-copy thread: a future per
        chunk copied goes to `copied`, and the caller keeps the chunks' pages referenced until each is done
        (nothing may write into them before)."""
        _, disk_keys = self._save(copies, host=False, disk=lambda c: session,
                                  remote=lambda c: session or self.shares_every_request, cataloged=True,
                                  copied=copied)
        return tuple(disk_keys)

    def write_through(self, copies: Sequence[ChunkCopy]) -> bool:
        """Queues chunks for the disk tier and the fleet (the shutdown flush), as many as the disk writer's
        queue has room for: False when it filled up first; then `wait()` (off the event loop) and call again.
        Chunks stored or queued already are skipped."""
        done, _ = self._save(copies, host=False, disk=lambda c: True, remote=lambda c: True, stop_when_full=True)
        return done

    def _save(self, copies: Sequence[ChunkCopy], host: bool, disk: Callable[[ChunkCopy], bool],
              remote: Callable[[ChunkCopy], bool], stop_when_full: bool = False,
              cataloged: bool = False, copied: list[Future] | None = None) -> tuple[bool, list[bytes]]:
        """Returns whether every copy was taken (False only with `stop_when_full`), and the disk keys of the
        copies the disk has or will have."""
        done, disk_keys = True, []
        for c in copies:
            key = self.epoch.key(c.span.last_hash)
            nbytes = len(c.block_ids) * self._geometry.bytes_per_block
            to_host = host and self.host is not None and not self.host.contains_prefix([key])
            on_disk = self.has_disk and disk(c)
            to_disk = on_disk and not self._writer.has(key)
            if to_disk and not self._writer.has_room(nbytes):
                to_disk = on_disk = False
                if stop_when_full:
                    done = False
                    break
                self._writer.note_dropped()
            if on_disk:
                disk_keys.append(key)
            remote_key = self._key("remote", c.span.last_hash) if remote(c) else None
            to_remote = remote_key is not None and not self._fleet_epoch.knows(remote_key)
            if to_remote and not self._remote_writer.has_room(nbytes):
                to_remote = False
                self._remote_writer.note_dropped()
            if not (to_host or to_disk or to_remote):
                continue
            identity = c.span.identity(self._geometry)
            if to_host:
                t0 = time.perf_counter()
                self._put_host(key, identity, lambda out, ids=c.block_ids: self._pages.gather_into(out, ids))
                self.transfer_stats.observe("host", "store", time.perf_counter() - t0, nbytes)
                self.counts["host"].writes += 1
            if not (to_disk or to_remote):
                continue
            if copied is None:
                kv: torch.Tensor | Future = self._pages.gather(c.block_ids)
            else:  # the writers take the copy when it is made: stored -> copying -> queued to write
                kv = self._store_copier.submit(self._pages.gather, c.block_ids)
                copied.append(kv)
            if to_disk:  # one transaction per chunk: chunks are megabytes
                self._writer.submit(key, identity, kv, cataloged=cataloged)
            if to_remote:
                self._remote_writer.submit(remote_key, identity, kv)
                self._fleet_epoch.remember(remote_key)
        return done, disk_keys

    # -- pins ----------------------------------------------------------------------------------

    def pin(self, tier: str, pin_id: str, copies: Sequence[ChunkCopy], share: float) -> bool:
        """Pins a chain's chunks in `tier` for `pin_id`, in place of what it pinned before. A chunk the tier
        lacks is saved there first from the device pages of its copy (a copy without pages must be there
        already). False when a chunk is neither there nor on the device. Raises TierPinError when the tier is
        off or the pin would take more than `share` of its capacity."""
        store = self._pin_store(tier)
        if store is None:
            reason = self.host_reason if tier == "host" else self.disk_reason or self._writer and self._writer.failure
            raise TierPinError(f"there is no {tier} tier to pin to ({reason}); pin to the device, or turn it on")
        keys = tuple(self.epoch.key(c.span.last_hash) for c in copies)
        nbytes = sum(c.span.num_pages for c in copies) * self.bytes_per_page
        old = self.pins.get(pin_id)
        budget = int(share * store.stats().capacity_bytes)
        others = sum(p.nbytes for i, p in self.pins.items() if p.tier == tier and i != pin_id)
        if others + nbytes > budget:
            raise TierPinError(f"this pin needs {nbytes >> 20} MiB of the {tier} tier and would make "
                               f"{(others + nbytes) >> 20} MiB pinned there, over its pin budget of "
                               f"{budget >> 20} MiB; unpin something or raise [qos] pin_share")
        missing = [(c, key) for c, key in zip(copies, keys) if not store.contains_prefix([key])]
        if any(not c.block_ids for c, _ in missing):
            return False
        for c, key in missing:
            identity = c.span.identity(self._geometry)
            if tier == "host":
                self._put_host(key, identity, lambda out, ids=c.block_ids: self._pages.gather_into(out, ids))
            else:  # on this thread, not the writer's: the pin must find the value committed
                frame = encode_frame(identity, _bytes(self._pages.gather(c.block_ids)), codec=self.disk_codec)
                self._writer.call(lambda: self.disk.put_many([(key, frame)], owner=identity.namespace), False)
        if store.pin(keys) != len(keys):  # a write failed, or another chunk's write evicted one
            store.unpin(keys)
            return False
        self.pins[pin_id] = TierPin(tier, keys, nbytes)
        if old is not None:  # a session pin following its session: what it no longer holds goes back to the LRU
            self._release_pin(old)
        return True

    def unpin(self, pin_id: str) -> TierPin | None:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self._release_pin(pin)
        return pin

    def pinned_bytes(self, tier: str) -> int:
        return sum(p.nbytes for p in self.pins.values() if p.tier == tier)

    def _release_pin(self, pin: TierPin) -> None:
        """Unpins a pin's chunks that no pin in `self.pins` holds (call once it is out of them)."""
        held = {k for p in self.pins.values() if p.tier == pin.tier for k in p.keys}
        store = self._pin_store(pin.tier)
        if store is not None:
            store.unpin([k for k in pin.keys if k not in held])

    def _pin_store(self, tier: str) -> HostStore | DiskStore | None:
        if tier == "host":
            return self.host
        return self.disk if tier == "disk" and self.has_disk else None

    # -- forgetting ----------------------------------------------------------------------------

    def forget(self, block_hashes: Sequence[bytes]) -> None:
        """Drops the chunks keyed by these pages' hashes (a session's own pages: every chunk of its chain
        past them is keyed by one of them)."""
        keys = [self.epoch.key(h) for h in block_hashes]
        if keys and self.host is not None:
            self.host.delete_many(keys)
        if keys and self.has_disk:
            self._writer.delete(keys)
        remote_keys = [k for k in (self._key("remote", h) for h in block_hashes) if k is not None]
        if remote_keys:
            self._fleet_epoch.forget(remote_keys)
            self._remote_writer.delete(remote_keys)

    def invalidate_all(self) -> None:
        """Makes everything stored so far unreachable (a new epoch, here and in the fleet); the LRU
        reclaims its room."""
        value = self.epoch.renew()
        for pin_id, pin in list(self.pins.items()):  # their chunks are unreachable now: let the LRU have them
            if (store := self._pin_store(pin.tier)) is not None:
                store.unpin(pin.keys)
            self.pins[pin_id] = TierPin(pin.tier, (), 0)
        if self._writer is not None:
            self._writer.run(lambda: self.epoch.save(value))
        if self._fleet_epoch is not None:
            self._fleet_epoch.bump()  # one INCR, bounded by the store's timeout

    def reconcile(self, cataloged: set[bytes]) -> Reconciliation | None:
        """Settles the disk tier against the keys the SQL catalog names (`cataloged`): deletes the values a
        session's turn wrote that it no longer names (their session was deleted meanwhile, or the daemon died
        before the turn was stored), and returns the cataloged keys the disk lacks, whose rows are to go.
        None without a disk tier. Runs on the disk writer's thread, after the writes queued before it."""
        if not self.has_disk:
            return None

        def settle() -> Reconciliation:
            orphans = [key for key in self.disk.cataloged_keys() if key not in cataloged]
            deleted = self.disk.delete_many(orphans) if orphans else 0
            missing = tuple(key for key in cataloged if not self.disk.contains_prefix([key]))
            return Reconciliation(deleted, missing)

        return self._writer.run(settle).result()

    # -- lifetime and reports ------------------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until the prefetches and writes queued so far are done (never call it on the event loop)."""
        self._prefetcher.submit(lambda: None).result()
        for writer in (self._writer, self._remote_writer):
            if writer is not None:
                writer.wait()

    def close(self) -> None:
        self.transfers.close()
        self._store_copier.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        for writer in (self._writer, self._remote_writer):
            if writer is not None:
                writer.close()
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            try:
                self.disk.close()
            except StoreUnavailableError:
                pass  # already failed; nothing left to save
        if self.host is not None:
            self.host.close()

    def stats(self) -> list[TierStats]:
        counts = self.counts
        host = host_stats(self.host, counts["host"]) if self.host is not None else \
            off_stats("host", self.host_reason, counts["host"])
        disk = writer_stats("disk", self.disk.stats(), self._writer, counts["disk"]) if self._writer is not None \
            else off_stats("disk", self.disk_reason, counts["disk"])
        if self.remote is None:
            return [host, disk]
        epoch_known = self._fleet_epoch.value is not None
        remote = writer_stats("remote", self.remote.stats(), self._remote_writer, counts["remote"],
                              None if epoch_known else "the fleet's epoch could not be read yet")
        return [host, disk, remote]

    # -- internals -----------------------------------------------------------------------------

    def _key(self, tier: str, block_hash: bytes) -> bytes | None:
        """A chunk's key in `tier`; None for the remote tier while the fleet's epoch is unknown."""
        if tier == "remote":
            return self._fleet_epoch.key(block_hash) if self._fleet_epoch is not None else None
        return self.epoch.key(block_hash)

    def _stores(self) -> list[tuple[str, Callable[[Sequence[bytes]], int]]]:
        """(tier, contains_prefix over last-page hashes) of each usable store, nearest first: the
        fastest serves a chunk several hold."""
        stores: list[tuple[str, Callable[[Sequence[bytes]], int]]] = []
        key = self.epoch.key
        if self.host is not None:
            host = self.host
            stores.append(("host", lambda hashes: host.contains_prefix([key(h) for h in hashes])))
        if self.has_disk:
            disk, writer = self.disk, self._writer
            stores.append(("disk", lambda hashes: int(writer.call(
                lambda: disk.contains_prefix([key(h) for h in hashes]), 0))))
        if self._fleet_epoch is not None and self._fleet_epoch.refresh() is not None:
            remote, fleet = self.remote, self._fleet_epoch
            stores.append(("remote", lambda hashes: remote.contains_prefix([fleet.key(h) for h in hashes])))
        return stores

    def _span(self, namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int], start: int,
              end: int) -> ChunkSpan:
        bs = self._geometry.block_size
        return ChunkSpan(namespace, start, tuple(block_hashes[start:end]), tuple(token_ids[start * bs : end * bs]))

    def _slot_bytes(self) -> int:
        """A host slot holds the largest frame: a whole chunk with the longest hashes and namespace."""
        g, n = self._geometry, self.chunk_pages
        widest = ChunkIdentity(g, bytes(MAX_HASH_BYTES), (bytes(MAX_HASH_BYTES),) * n, (0,) * (n * g.block_size))
        return frame_nbytes(widest, HOST_CODEC, widest.payload_nbytes) + ALIGN - 1  # room to align the payload

    def _put_host(self, key: bytes, identity: ChunkIdentity, fill: Callable[[torch.Tensor], None]) -> None:
        """Writes a raw frame into a host slot: `fill` puts the KV in place (`[layers, 2, pages, ...]`), then
        the head goes before it with the payload's checksum."""
        nbytes = identity.payload_nbytes
        head_len = len(frame_head(identity, HOST_CODEC, nbytes, 0))
        shape = self._pages.shape(identity.num_pages)

        def write(value: torch.Tensor) -> None:
            payload = value[head_len:]
            fill(payload.view(self._geometry.dtype).view(shape))
            checksum = xxhash.xxh3_64_intdigest(payload.numpy())
            value.numpy()[:head_len] = np.frombuffer(frame_head(identity, HOST_CODEC, nbytes, checksum), np.uint8)

        self.host.write(key, head_len + nbytes, write, align_at=head_len, owner=identity.namespace)


def _bytes(kv: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy())


def _writable(payload: Buffer) -> memoryview:
    """torch.frombuffer needs a writable buffer: a read-only one (a zstd payload, a remote value) is copied.
    A disk value is a bytearray already, and the raw codec decodes it to a view of itself."""
    view = memoryview(payload)
    return memoryview(bytearray(view)) if view.readonly else view


def _copy_bytes(out: torch.Tensor, payload: memoryview) -> None:
    out.view(-1).view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8))
