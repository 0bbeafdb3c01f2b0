"""The host tier: chunk values in one preallocated slab of fixed-size slots.

    slab  uint8 [num_slots, slot_bytes]   one chunk per slot, values stored raw (no codec)

The slab is allocated once, so the tier never fragments and never allocates on
the copy path. With CUDA it is pinned (page-locked): device<->host copies then
run as DMA, and the budget is RAM the kernel can never swap out. Without CUDA it
is ordinary pageable memory (`pinned` is False in the stats).

When every slot is taken, a put reuses the least recently used slot that is not
pinned (`pin`: a pinned value stays until unpinned or deleted) and not being
read. Writes copy under the store's lock; `read` hands its slot to the caller
outside the lock, so loads of different chunks copy side by side, and a slot
being read is never rewritten: a put or delete of its key meanwhile takes
another slot, and the old one is freed when its last reader is done. With
shares (`share_by`), each value has an owner (its tenant's namespace) and the
slot comes from the owner with the most slots per unit of weight, its least
recently used value: a tenant's flood evicts its own values before another
tenant's. With a cap (`limit_by`), an owner holding its cap in slots replaces
its own least recently used value rather than take a free slot or another
owner's.

Besides the ChunkStore calls (bytes in, bytes out), `write` and `read` hand the
caller a view of the slot itself, so the tier manager copies KV between device
pages and the slab once, with no bytes object in between. `write` can place a
value so that one of its bytes (the payload's first) sits on a 64-byte boundary:
what follows can then be viewed as any dtype.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from kvtierd.storage.chunk_store import StoreStats
from kvtierd.storage.owner_shares import by_standing
from kvtierd.storage.store_errors import StoreUnavailableError

ALIGN = 64  # bytes: a cache line, and every dtype's alignment
T = TypeVar("T")


@dataclass(slots=True)
class _Slot:
    index: int  # row of the slab
    nbytes: int  # bytes of the value in it (a value may be shorter than the slot)
    offset: int = 0  # where the value starts in its row (see `write`)
    owner: bytes = b""  # the tenant namespace it belongs to (shares); b"": unknown


class HostStore:
    """A ChunkStore in host memory, plus tensor copies in and out of slots for the tier manager."""

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.num_slots = capacity_bytes // slot_bytes
        if self.num_slots == 0:
            raise ValueError(f"a host budget of {capacity_bytes} bytes holds no slot of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.pinned = torch.cuda.is_available()
        self._slab = torch.empty((self.num_slots, slot_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        self._rows = self._slab.numpy()  # the same memory, for copies from and to bytes
        self._index: OrderedDict[bytes, _Slot] = OrderedDict()  # least recently used first
        self._free = list(range(self.num_slots))
        self._pinned: set[bytes] = set()  # keys the LRU must pass over
        self._readers: Counter[int] = Counter()  # slot index -> `read` calls copying from it now
        self._retired: dict[int, _Slot] = {}  # slots dropped while being read: freed when the readers are done
        self._weight: Callable[[bytes], float] | None = None  # an owner's weight; None: one LRU for all
        self._owned: Counter[bytes] = Counter()  # slots holding a value, per owner
        self._cap: Callable[[bytes], int | None] = lambda owner: None  # slots an owner may hold (None: any)
        self._lock = threading.Lock()
        self._closed = False
        self._used = 0
        self._num_puts = self._num_gets = self._num_hits = 0
        self._num_evictions = self._num_rejected = 0

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self._check_open()
            for n, key in enumerate(keys):
                if key not in self._index:
                    return n
            return len(keys)

    def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [key in self._index for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            self._check_open()
            slots = [self._use(key) for key in keys]
            return [None if s is None else self._rows[s.index, s.offset : s.offset + s.nbytes].tobytes() for s in slots]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> bool:
        batch = dict(items)  # a key given twice keeps its last value
        for value in batch.values():
            self._check_size(len(value))
        with self._lock:
            self._check_open()
            if len(batch) > self.num_slots - len(self._pinned):
                self._num_rejected += 1
                return False
            # Keys being rewritten keep their slots, and are out of the LRU while the others take theirs.
            reused = {key: slot for key in batch if (slot := self._unindex(key)) is not None
                      and not self._retire_if_read(slot)}
            for key, value in batch.items():
                slot = reused.get(key) or self._take_slot()
                self._used += len(value) - slot.nbytes
                slot.nbytes, slot.offset, slot.owner = len(value), 0, b""
                self._rows[slot.index, : slot.nbytes] = np.frombuffer(value, dtype=np.uint8)
                self._index[key] = slot
                self._owned[b""] += 1
            self._num_puts += len(batch)
            return True

    def delete_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self._check_open()
            deleted = 0
            for key in keys:
                slot = self._unindex(key)
                self._pinned.discard(key)
                if slot is not None:
                    self._retire(slot)
                    deleted += 1
            return deleted

    def share_by(self, weight: Callable[[bytes], float]) -> None:
        """Evicts from the owner with the most slots per unit of `weight(owner)` first."""
        self._weight = weight

    def limit_by(self, cap_bytes: Callable[[bytes], int | None]) -> None:
        """An owner may hold at most `cap_bytes(owner)` bytes of slots (None: no cap); at least one slot."""
        self._cap = lambda owner: None if (c := cap_bytes(owner)) is None else max(1, c // self.slot_bytes)

    def slots_by_owner(self) -> dict[bytes, int]:
        with self._lock:
            return {owner: n for owner, n in self._owned.items() if n}

    def write(self, key: bytes, nbytes: int, fill: Callable[[torch.Tensor], None], align_at: int = 0,
              owner: bytes = b"") -> None:
        """Stores a value of `nbytes` that `fill` writes in place into the flat uint8 tensor it is given
        (the slot itself, under the store's lock). The value's byte `align_at` lands on a 64-byte boundary.
        The slot must have room for the value and up to ALIGN - 1 bytes before it. If `fill` raises, the
        key is left absent."""
        self._check_size(nbytes + ALIGN - 1)
        with self._lock:
            self._check_open()
            slot = self._unindex(key)
            if slot is None or self._retire_if_read(slot):
                slot = self._take_own(owner) or self._take_slot()
            offset = (-(self._slab.data_ptr() + slot.index * self.slot_bytes + align_at)) % ALIGN
            self._used -= slot.nbytes
            slot.nbytes, slot.offset, slot.owner = 0, offset, owner
            try:
                fill(self._slab[slot.index, offset : offset + nbytes])
            except BaseException:
                self._release(slot)
                raise
            self._used += nbytes
            slot.nbytes = nbytes
            self._index[key] = slot
            self._owned[owner] += 1
            self._num_puts += 1

    def read(self, key: bytes, use: Callable[[torch.Tensor], T]) -> T | None:
        """`use(value)` with the value as a flat uint8 view of its slot, outside the store's lock (the slot is
        not rewritten meanwhile; do not keep the view). None on a miss."""
        with self._lock:
            self._check_open()
            slot = self._use(key)
            if slot is None:
                return None
            self._readers[slot.index] += 1
            value = self._slab[slot.index, slot.offset : slot.offset + slot.nbytes]
        try:
            return use(value)
        finally:
            with self._lock:
                self._readers[slot.index] -= 1
                if not self._readers[slot.index]:
                    del self._readers[slot.index]
                    if (retired := self._retired.pop(slot.index, None)) is not None:
                        self._release(retired)

    def pin(self, keys: Sequence[bytes]) -> int:
        """Keeps these values until unpinned or deleted; returns how many were there to pin."""
        with self._lock:
            present = [key for key in keys if key in self._index]
            self._pinned.update(present)
            return len(present)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pinned.difference_update(keys)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                num_entries=len(self._index),
                bytes_used=self._used,
                capacity_bytes=self.num_slots * self.slot_bytes,
                num_puts=self._num_puts,
                num_gets=self._num_gets,
                num_hits=self._num_hits,
                num_evictions=self._num_evictions,
                num_rejected=self._num_rejected,
                num_corrupt=0,  # raw values carry no checksum; the tier manager's token check guards hits
                num_quarantined=0,
                healthy=not self._closed,
                reason="closed" if self._closed else None,
                pinned=self.pinned,
            )

    def close(self) -> None:
        """Frees the slab; the store is unusable afterwards."""
        with self._lock:
            self._closed = True
            self._index.clear()
            self._slab = self._rows = None  # type: ignore[assignment]

    def _use(self, key: bytes) -> _Slot | None:
        """Looks a key up and counts it: a hit becomes the most recently used."""
        self._num_gets += 1
        slot = self._index.get(key)
        if slot is not None:
            self._num_hits += 1
            self._index.move_to_end(key)
        return slot

    def _take_slot(self) -> _Slot:
        """A free slot, or the least recently used one (its value is evicted). Caller holds the lock."""
        if self._free:
            return _Slot(self._free.pop(), 0)
        victim = None
        if self._weight is not None:
            # Owners by slots per weight, most first; the first with an evictable value gives its oldest.
            for owner in by_standing(self._owned, self._weight):
                if (victim := self._oldest_evictable(owner)) is not None:
                    break
        if victim is None:
            victim = self._oldest_evictable()
        if victim is None:  # the pin budget (a share of the slots) keeps this from happening
            raise StoreUnavailableError("every host slot is pinned or being read")
        self._num_evictions += 1
        return self._unindex(victim)

    def _take_own(self, owner: bytes) -> _Slot | None:
        """The owner's least recently used slot when it holds its cap, else None. Caller holds the lock."""
        cap = self._cap(owner)
        if cap is None or self._owned[owner] < cap:
            return None
        victim = self._oldest_evictable(owner)
        if victim is None:
            return None
        self._num_evictions += 1
        return self._unindex(victim)

    def _oldest_evictable(self, owner: bytes | None = None) -> bytes | None:
        """The least recently used key (of `owner`, when given) neither pinned nor being read."""
        return next((key for key, slot in self._index.items() if (owner is None or slot.owner == owner)
                     and key not in self._pinned and slot.index not in self._readers), None)

    def _unindex(self, key: bytes) -> _Slot | None:
        """Takes a key's slot out of the index (and its owner's count); None when absent."""
        slot = self._index.pop(key, None)
        if slot is not None:
            self._owned[slot.owner] -= 1
        return slot

    def _retire(self, slot: _Slot) -> None:
        """Frees a slot whose key is gone, or once its readers are done."""
        if not self._retire_if_read(slot):
            self._release(slot)

    def _retire_if_read(self, slot: _Slot) -> bool:
        """Sets a slot being read aside, to be freed by its last reader; whether it was being read."""
        if slot.index in self._readers:
            self._retired[slot.index] = slot
            return True
        return False

    def _release(self, slot: _Slot) -> None:
        self._used -= slot.nbytes
        self._free.append(slot.index)

    def _check_size(self, nbytes: int) -> None:
        # A chunk never outgrows its slot; a bigger value is the caller's bug.
        if nbytes > self.slot_bytes:
            raise ValueError(f"a value of {nbytes} bytes does not fit a slot of {self.slot_bytes}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError("the host KV store is closed")
