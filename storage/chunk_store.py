"""The one batched interface of the lower KV tiers (host slab, LMDB disk, Redis).

Keys are chunk keys (the chained hash of a chunk's last page); values are opaque
bytes to the store. Every call is synchronous: the tier manager calls stores from
its worker threads, never from the event loop.

Running out of room is not an error: a full store evicts its least recently used
values, and `put_many` returns False only for a batch that could never fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StoreStats:
    num_entries: int
    bytes_used: int  # what the values take, store overhead included where the store knows it
    capacity_bytes: int  # what values may take in all
    num_puts: int  # values written since open
    num_gets: int  # values asked for since open
    num_hits: int
    num_evictions: int  # values dropped to make room
    num_rejected: int  # batches refused because they could never fit
    num_corrupt: int  # values reported bad since open (quarantine calls)
    num_quarantined: int  # bad values held for inspection now
    healthy: bool
    reason: str | None = None  # why the store is not healthy
    pinned: bool = False  # host slab only: page-locked memory, so device copies can be asynchronous DMA
    num_failures: int = 0  # remote tier only: calls answered as a miss because the server failed or was cut off


class ChunkStore(Protocol):
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of the leading keys are stored; stops at the first missing one."""
        ...

    def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored, in one call (one round trip for a remote store)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values, None for a miss. A hit counts as a use for the LRU."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> bool:
        """Stores the whole batch or none of it (evicting LRU values for room); False if it can never fit."""
        ...

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Deletes the keys; returns how many were there."""
        ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...
