"""What a lower tier is to the tier manager: one interface that the host slab, the LMDB disk store and the
fleet's Redis each implement (`host_backend.py`, `disk_backend.py`, `remote_backend.py`).

    lookup     holds_each(hashes)           whether the tier holds each of these chunks (one call)
    load       load(span, skip, pages)      one chunk checked and copied into device pages (a transfer worker)
               read_ahead(spans)            values a request's later loads will ask for, read now (remote:
                                            `read_ahead.py`); drop_read_ahead(spans) when it ends first
               fetch(span)                  one chunk's checked payload, for a prefetch to the host tier
                                            (disk and remote: `writer_backend.py`)
    store      admit(hash, nbytes, drop)    held already, taken, full (then counted dropped), or off
               store(hash, identity, chunk) the chunk taken from device pages (`DeviceChunk`)
    delete     delete(hashes), invalidate() one chain's chunks; everything stored so far
    pin        pin(keys) / unpin(keys)      host and disk only (`PinnableBackend`)
    report     stats()                      one `TierStats` row

A backend owns its keys (`key`: the chunk's last page hash mixed with its
epoch), its codec, its store and the thread that writes it. The tier manager
keeps the policy: which tiers a chunk goes to, in what order they are asked,
pins and their budgets, what a load counts for. A tier is a `Tier` value
(`tier.py`); its string is for settings, JSON and metric labels.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from kvtierd.storage.kv_frame import ChunkIdentity
from kvtierd.tiers.chunk import ChunkSpan
from kvtierd.tiers.device_chunk import DeviceChunk
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_stats import TierCounts, TierStats


class Admission(enum.Enum):
    """What a tier says to a chunk offered to it."""

    HELD = "held"  # stored or on its way already
    TAKE = "take"  # not held, and there is room to queue it
    FULL = "full"  # not held, and no room now: dropped (or waited for, by a flush)
    OFF = "off"  # the tier cannot take anything now (its store failed, or it cannot name the chunk)


class TierBackend(Protocol):
    tier: Tier
    counts: TierCounts  # what its loads, stores and checks did (the manager counts hits and prefetches)

    def usable(self) -> bool:
        """Whether it can be asked now (its store works, its keys are known)."""
        ...

    def key(self, block_hash: bytes) -> bytes | None:
        """The key of the chunk whose last page has `block_hash`; None while the tier cannot name it."""
        ...

    def holds_each(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether it holds each chunk keyed by these last-page hashes, in one call (one round trip)."""
        ...

    def load(self, span: ChunkSpan, skip: int, block_ids: Sequence[int]) -> bool:
        """Copies pages `skip`.. of the chunk into device pages `block_ids`. False when it is gone or fails
        its checks (a bad value is dropped or quarantined). Runs on a transfer worker."""
        ...

    def read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        """Starts reading these chunks for the loads that will ask for them, where round trips are what a load
        waits on (the others read as they load: nothing to do)."""
        ...

    def drop_read_ahead(self, spans: Sequence[ChunkSpan]) -> None:
        """Forgets what `read_ahead` started for these chunks (their request ended before loading them)."""
        ...

    def admit(self, block_hash: bytes, nbytes: int, drop: bool = True) -> Admission:
        """Whether it takes this chunk now; a FULL one is counted as dropped when `drop` (else the caller
        waits and offers it again)."""
        ...

    def store(self, block_hash: bytes, identity: ChunkIdentity, chunk: DeviceChunk, cataloged: bool) -> None:
        """Stores a chunk `admit` took (`cataloged`: a session's turn, which the SQL catalog will name)."""
        ...

    def delete(self, block_hashes: Sequence[bytes]) -> None: ...

    def invalidate(self) -> None:
        """Makes what it stored so far unreachable (the manager has renewed the local epoch)."""
        ...

    def stats(self) -> TierStats: ...

    def wait(self) -> None:
        """Blocks until what was queued so far is stored (never on the event loop)."""
        ...

    def close(self) -> None: ...


class PinnableBackend(TierBackend, Protocol):
    """A tier this host owns (host, disk): its chunks can be kept out of its LRU."""

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def failure(self) -> str | None:
        """Why it cannot take pins now (None: it can)."""
        ...

    def has(self, key: bytes) -> bool: ...

    def store_now(self, key: bytes, identity: ChunkIdentity, block_ids: Sequence[int]) -> None:
        """Stores a chunk from device pages on this thread: a pin must find it stored when it returns."""
        ...

    def pin(self, keys: Sequence[bytes]) -> int:
        """Pins these keys; returns how many it holds."""
        ...

    def unpin(self, keys: Sequence[bytes]) -> None: ...
