"""The remote tier: the fleet's Redis or Valkey (`storage/redis_store.py`), frames in the fleet's codec, sealed
and sent by its writer thread, read on the caller's thread, or ahead of a request's loads on threads of their
own when its round trips are slow (`read_ahead.py`; every call bounded by the store's timeout and circuit
breaker).

Its lookups ask the store's directory (`storage/redis_directory.py`) when it follows the fleet's stores and
knows, the server otherwise: a far Redis's round trip is then no new prompt's wait, hit or miss.

Its keys mix in the fleet's epoch (`fleet_epoch.py`), kept in Redis, instead of the local one: an
invalidation on one host reaches the others. While that epoch is unknown the tier names nothing and is not
used. The epoch also remembers what this host stored or found, so a chunk goes to the fleet once.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

from kvtierd.storage.codecs import Between, Buffer, no_pause
from kvtierd.storage.kv_frame import ChunkIdentity
from kvtierd.storage.redis_store import RedisStore
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.chunk import ChunkSpan
from kvtierd.tiers.device_chunk import DeviceChunk
from kvtierd.tiers.fleet_epoch import FleetEpoch
from kvtierd.tiers.frame_pages import scatter_payload
from kvtierd.tiers.page_copy import PageCopier
from kvtierd.tiers.read_ahead import ReadAhead
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_stats import TierCounts, TierStats
from kvtierd.tiers.transfer import TransferStats
from kvtierd.tiers.writer_backend import WriterBackend


# Small calls whose round trips take longer than this (an average weighting the latest half): the values of a
# request's later chunks are read ahead (`read_ahead.py`). A loopback call takes well under a millisecond and a
# chunk's GET 10-25 ms; a slow or far Redis's calls are its delay, which its loads would otherwise wait one pair at
# a time.
READ_AHEAD_PAST_S = 0.05
# While an engine computes, a request's values read ahead are asked for one call this far apart (at most its round
# trip spread over them): the server executes each value's GET on its own, beside a step or two, not a request's
# at once (`read_ahead.py`). Through `bench stall`'s slow Redis (300 ms a call, on this host), 8 loads a run: the
# streams' ITL p99 1.43x their own in one call, 1.27x and 1.31x at 40 and 60 ms, the loads' TTFT the same (939 ms
# against 942 and 985): beside the streams a paced load takes a value every ~65 ms.
READ_AHEAD_SPACING_S = 0.04


class RemoteBackend(WriterBackend):
    tier = Tier.REMOTE

    def __init__(self, store: RedisStore, codec: str, max_pending_bytes: int, pages: PageCopier,
                 counts: TierCounts, transfer_stats: TransferStats, defer_s: float = 0.0) -> None:
        super().__init__(store, codec, max_pending_bytes, pages, counts, transfer_stats, defer_s)
        self.fleet_epoch = FleetEpoch(store)
        self._read_ahead = ReadAhead(store.send_gets)
        self.read_ahead_past_s = READ_AHEAD_PAST_S

    def usable(self) -> bool:
        """The fleet's epoch is known (read again every FLEET_EPOCH_REFRESH_S, on a thread of its own)."""
        return self.fleet_epoch.refresh() is not None

    def key(self, block_hash: bytes) -> bytes | None:
        return self.fleet_epoch.key(block_hash) if self.fleet_epoch.value is not None else None

    def holds_each(self, block_hashes: Sequence[bytes]) -> list[bool]:
        keys = [self.fleet_epoch.key(h) for h in block_hashes]
        known = self.storage.known_each(keys)
        return known if known is not None else self.storage.contains_each(keys)

    def _holds(self, key: bytes) -> bool:
        return self.fleet_epoch.knows(key)

    def read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        """Starts reading these chunks' values for the loads that will ask for them (`read_ahead.py`), when the
        server's round trips lately took longer than `read_ahead_past_s`; spaced while an engine computes."""
        round_trip_s = self.storage.round_trip_s
        if round_trip_s is None or round_trip_s <= self.read_ahead_past_s:
            return
        keys = [k for k in (self.key(s.last_hash) for s in spans) if k is not None]
        spaced = BACKGROUND_WORK.computing and len(keys) > 1
        self._read_ahead.start(keys, min(READ_AHEAD_SPACING_S, round_trip_s / len(keys)) if spaced else 0.0)

    def drop_read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        self._read_ahead.drop(k for k in (self.key(s.last_hash) for s in spans) if k is not None)

    def _get(self, key: bytes, between: Between = no_pause) -> Buffer | None:
        # A load that yields to the steps waits for the server beside them, the turn passed on: as a slice, a slow
        # Redis's answer held the step that lent it up to SLICE_WAIT_S, and the other load behind it.
        # Its value is read off the socket after that, in the load's slice: beside the steps, a value's receive
        # slowed them as any work there does.
        waiting = BACKGROUND_WORK.unsliced if BACKGROUND_WORK.pacing() else None
        ahead = self._read_ahead.take(key)
        if ahead is None:
            return self.storage.get_many([key], between, waiting)[0]
        with waiting() if waiting is not None else nullcontext():
            ahead.wait()
        return self.storage.unseal_many([key], [ahead.read()], between)[0]

    def _found(self, key: bytes) -> None:
        self.fleet_epoch.remember(key)  # the fleet has it: no need to send it back

    def _forget(self, keys: Sequence[bytes]) -> None:
        self.fleet_epoch.forget(keys)

    def store(self, block_hash: bytes, identity: ChunkIdentity, chunk: DeviceChunk, cataloged: bool = False) -> None:
        super().store(block_hash, identity, chunk)  # the SQL catalog names disk values only

    def load(self, span: ChunkSpan, skip: int, block_ids: Sequence[int]) -> bool:
        payload = self.fetch(span)
        if payload is None:
            return False
        scatter_payload(self._pages, payload, span.num_pages, skip, block_ids)
        return True

    def invalidate(self) -> None:
        self._read_ahead.clear()
        self.fleet_epoch.bump()  # one INCR, bounded by the store's timeout

    def stats(self) -> TierStats:
        unknown = self.fleet_epoch.value is None
        directory = self.storage.directory
        known = directory.num_keys if directory is not None and directory.complete else None
        return replace(super().stats("the fleet's epoch could not be read yet" if unknown else None),
                       known_chunks=known)

    def close(self) -> None:
        self._read_ahead.close()
        self.writer.close()
        self.storage.close()
