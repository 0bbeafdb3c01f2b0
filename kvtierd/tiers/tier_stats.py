"""What the lower tiers report: counts the tier manager keeps, one `TierStats` per tier, and what the
startup reconciliation with the SQL chunk catalog found."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.storage.chunk_store import StoreStats
from kvtierd.storage.host_store import HostStore
from kvtierd.tiers.chunk_writer import ChunkWriter
from kvtierd.tiers.tier import Tier


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """What settling the disk tier against the SQL chunk catalog found (at startup)."""

    orphan_values: int  # values a session's turn wrote that no catalog row names any more: deleted
    missing_keys: tuple[bytes, ...]  # cataloged keys the disk does not hold (evicted, bad, never committed)


@dataclass(slots=True)
class TierCounts:
    hits: int = 0  # chunks loaded into the device
    hit_tokens: int = 0  # prompt tokens those loads served
    writes: int = 0  # chunks stored (the host's; the disk writer counts its own)
    corrupt: int = 0  # values that failed their checks (never served)
    prefetched: int = 0  # chunks of this tier copied up to the host tier ahead of their request


@dataclass(frozen=True, slots=True)
class TierStats:
    name: Tier
    enabled: bool  # the store is there (not turned off, and it opened)
    healthy: bool
    reason: str | None  # why it is off or unhealthy
    capacity_bytes: int
    used_bytes: int
    entries: int
    hits: int
    hit_tokens: int
    writes: int
    pending_writes: int  # disk, remote: chunks copied out, not yet stored
    dropped_writes: int  # disk, remote: chunks not written (queue full or store failed)
    evictions: int  # values the store dropped for room
    corrupt: int
    pinned: bool  # host: page-locked memory
    prefetched: int = 0  # disk, remote: chunks copied up to the host tier ahead of their request
    codec: str | None = None  # how its values are encoded (None: the tier is off)
    known_chunks: int | None = None  # remote: chunks its directory knows the fleet holds (None: not following)


def host_stats(host: HostStore, c: TierCounts) -> TierStats:
    s = host.stats()
    return TierStats(Tier.HOST, True, s.healthy, s.reason, s.capacity_bytes, s.bytes_used, s.num_entries,
                     c.hits, c.hit_tokens, c.writes, 0, 0, s.num_evictions, c.corrupt, s.pinned, codec="raw")


def writer_stats(name: Tier, s: StoreStats, w: ChunkWriter, c: TierCounts, unhealthy: str | None = None) -> TierStats:
    """A tier written by a writer thread (disk, remote); `unhealthy` says why it is not usable when the
    store itself is fine."""
    healthy = s.healthy and w.failure is None and unhealthy is None
    return TierStats(name, True, healthy, w.failure or s.reason or unhealthy, s.capacity_bytes, s.bytes_used,
                     s.num_entries, c.hits, c.hit_tokens, w.num_written, w.num_pending, w.num_dropped,
                     s.num_evictions, s.num_corrupt, False, c.prefetched, w.codec)


def off_stats(name: Tier, reason: str | None, c: TierCounts) -> TierStats:
    return TierStats(name, False, False, reason, 0, 0, 0, c.hits, c.hit_tokens, c.writes, 0, 0, 0, c.corrupt, False)
